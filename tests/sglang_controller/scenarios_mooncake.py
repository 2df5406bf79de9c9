"""MMEncoder's request sequence on 2 gloo ranks with a real ``mooncake_master`` as the global
store: two controllers (two encode workers) share it, and a master that dies mid-run.

Arguments (``Rank.args``): ``store`` (``MooncakeStore`` keywords for the shared master),
``prefix`` (this run's key namespace) and ``binary`` (``mooncake_master``, for a private master
that rank 0 starts and kills).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from embcache.integrations.sglang import EmbeddingCacheController
from embcache.integrations.sglang_legacy import LegacyEmbeddingCacheController
from embcache.store.mooncake import MooncakeStore
from embcache.store.mooncake_master import MooncakeMaster
from tests.sglang_controller.scenarios import GB, POOL, assert_idle, check, keys_of
from tests.support.helpers import publishes_ended, wait_until
from tests.support.rank_scenarios import Rank, Scenario
from tests.support.sglang_mmencoder import DIM, DTYPE, Encoder, Modality, serve, serve_legacy

SEGMENT = 64 << 20


def mooncake(stack: ExitStack, r: Rank, store: dict[str, Any], segment: int = 0) -> MooncakeStore:
    return stack.enter_context(
        MooncakeStore(
            **store,
            key_prefix=r.args["prefix"],
            global_segment_size=segment,
            connect_timeout_s=0.5,
            reconnect_interval_s=0.2,
        )
    )


def controller(stack: ExitStack, r: Rank, store: MooncakeStore) -> EmbeddingCacheController:
    ctl = EmbeddingCacheController(
        store, max_pool_size_gb=POOL / GB, hidden_dims={Modality.IMAGE: DIM}, dtype=DTYPE
    )
    stack.callback(ctl.close)
    return ctl


def legacy_controller(
    stack: ExitStack, r: Rank, store: MooncakeStore
) -> LegacyEmbeddingCacheController:
    import torch.distributed as dist

    ctl = LegacyEmbeddingCacheController(
        r.rank,
        r.world,
        POOL / GB,
        {Modality.IMAGE: DIM},
        dist.group.WORLD,
        embedding_store=store,
        dtype=DTYPE,
    )
    stack.callback(ctl.close)
    return ctl


def wait_published(ctl: Any) -> None:
    wait_until(lambda: publishes_ended(ctl.cache), "publishes to end")
    stats = ctl.cache.stats()
    assert stats.publishes_failed == stats.publishes_unknown == 0, stats


def global_hits_between_two_controllers(r: Rank) -> None:
    with ExitStack() as stack:
        shared = r.args["store"]
        first = controller(stack, r, mooncake(stack, r, shared, SEGMENT))
        second = controller(stack, r, mooncake(stack, r, shared))
        encoder = Encoder()
        keys, tokens = keys_of("mg", "abcd")
        check(
            r,
            serve(first, r.rank, r.world, "g1", keys, tokens, encoder),
            keys,
            tokens,
            [0] * 4,
            [0] * 4,
        )
        if r.rank == 0:
            wait_published(first)
        for i, gpu_output in enumerate([False, True]):
            served = serve(
                second, r.rank, r.world, f"g{i + 2}", keys, tokens, encoder, gpu_output=gpu_output
            )
            check(r, served, keys, tokens, [1] * 4, [0] * 4)
        assert encoder.calls == [keys]
        if r.rank == 0:
            assert second.cache.stats().loads_ok == 4
            assert_idle(first)
            assert_idle(second)


def legacy_global_hits_between_two_controllers(r: Rank) -> None:
    with ExitStack() as stack:
        workers = [
            legacy_controller(stack, r, mooncake(stack, r, r.args["store"], segment))
            for segment in (SEGMENT, 0)
        ]
        encoder = Encoder()
        keys, tokens = keys_of("ml", "abc")
        served = serve_legacy(workers[0], r.rank, r.world, "l1", keys, tokens, encoder)
        check(r, served, keys, tokens, [0] * 3, [0] * 3)
        if r.rank == 0:
            wait_published(workers[0])
        served = serve_legacy(workers[1], r.rank, r.world, "l2", keys, tokens, encoder)
        check(r, served, keys, tokens, [1] * 3, [0] * 3)
        assert encoder.calls == [keys]
        if r.rank == 0:
            assert workers[1].cache.stats().loads_ok == 3
            for ctl in workers:
                assert_idle(ctl)


@contextmanager
def private_master(r: Rank) -> Iterator[MooncakeMaster | None]:
    """Rank 0's own master (it kills it); None on other ranks."""
    if r.rank != 0:
        yield None
        return
    master = MooncakeMaster(r.args["binary"], ports=r.args["master_ports"])
    master.start()
    try:
        yield master
    finally:
        master.stop()


def dead_master(r: Rank) -> None:
    with ExitStack() as stack:
        master = stack.enter_context(private_master(r))
        kwargs = master.store_kwargs() if master is not None else r.args["store"]
        first = controller(stack, r, mooncake(stack, r, kwargs, SEGMENT))
        second = controller(stack, r, mooncake(stack, r, kwargs))
        old = legacy_controller(stack, r, mooncake(stack, r, kwargs))
        encoder = Encoder()
        keys, tokens = keys_of("md", "ab")
        check(
            r,
            serve(first, r.rank, r.world, "d1", keys, tokens, encoder),
            keys,
            tokens,
            [0, 0],
            [0, 0],
        )
        if master is not None:
            wait_published(first)

        def kill() -> None:
            assert master is not None
            master.kill()

        # Found in the global store, then the master dies before the load: both fall back.
        served = serve(second, r.rank, r.world, "d2", keys, tokens, encoder, after_lookup=kill)
        check(r, served, keys, tokens, [1, 1], [1, 1])
        # The master is gone at lookup: batch_is_exist raises, MMEncoder encodes everything.
        more, more_tokens = keys_of("md", "ac")
        served = serve(second, r.rank, r.world, "d3", more, more_tokens, encoder)
        check(r, served, more, more_tokens, [1, 0], [0, 0])  # md-a: local since d2
        # The older method set on the dead master: a miss, inserted, its publish fails.
        served = serve_legacy(old, r.rank, r.world, "d4", more, more_tokens, encoder)
        check(r, served, more, more_tokens, [0, 0], [0, 0])
        assert encoder.calls == [keys, keys, ["md-c"], more]
        if r.rank == 0:
            for ctl in (first, second, old):
                assert_idle(ctl)
            stats = second.cache.stats()
            assert stats.entries_by_state.get("READY") == 3, stats
            assert stats.publishes_ok == 0, stats
            stats = old.cache.stats()
            assert stats.entries_by_state.get("READY") == 2 and stats.publishes_ok == 0, stats


SCENARIOS: list[Scenario] = [
    global_hits_between_two_controllers,
    legacy_global_hits_between_two_controllers,
    dead_master,
]
