"""MMEncoder's request sequence against embcache's SGLang controllers on 2 gloo ranks, with the
embedded ``FaultInjectingStore`` as the global store (its fault injection makes partial loads).

Each scenario runs on every rank: every rank builds the controller (its constructor makes the
gloo group, a collective), only rank 0 calls it, both broadcast the masks and encode the
masked items. Checks: masks and encoder calls equal on both ranks and as expected, the bytes
rank 0 assembles equal the encoder's, and afterwards no pin, no open request, no load in
flight, and ``check_invariants()``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from embcache.integrations.sglang import EmbeddingCacheController
from embcache.integrations.sglang_legacy import LegacyEmbeddingCacheController
from embcache.testing import Fault, FaultInjectingStore
from tests.support import helpers
from tests.support.helpers import raw
from tests.support.rank_scenarios import Rank, Scenario
from tests.support.sglang_mmencoder import (
    DIM,
    DTYPE,
    Encoder,
    Modality,
    Served,
    embedding,
    serve,
    serve_legacy,
)

GB = 1 << 30
POOL = 64 << 10  # bytes: one token is DIM * 2 = 32 bytes
TOKENS = {"a": 3, "b": 5, "c": 2, "d": 4, "e": 7}


def controller(r: Rank, store: Any, pool: int = POOL) -> EmbeddingCacheController:
    return EmbeddingCacheController(
        store, max_pool_size_gb=pool / GB, hidden_dims={Modality.IMAGE: DIM}, dtype=DTYPE
    )


def legacy(r: Rank, store: Any, pool: int = POOL) -> LegacyEmbeddingCacheController:
    import torch.distributed as dist

    return LegacyEmbeddingCacheController(
        r.rank,
        r.world,
        pool / GB,
        {Modality.IMAGE: DIM},
        tp_group=dist.group.WORLD,
        embedding_store=store,
        dtype=DTYPE,
    )


def keys_of(prefix: str, names: str) -> tuple[list[str], list[int]]:
    return [f"{prefix}-{n}" for n in names], [TOKENS[n] for n in names]


def expected(keys: Sequence[str], tokens: Sequence[int]) -> torch.Tensor:
    return torch.cat([embedding(k, n) for k, n in zip(keys, tokens, strict=True)])


def check(
    r: Rank,
    served: Served,
    keys: Sequence[str],
    tokens: Sequence[int],
    exist: list[int],
    fallback: list[int],
) -> None:
    """Masks as expected on every rank, rank 0's bytes the encoder's, background insert done."""
    assert served.exist_mask == exist, served.exist_mask
    assert served.fallback_mask == fallback, served.fallback_mask
    r.same_on_every_rank((served.exist_mask, served.fallback_mask))
    if r.rank == 0:
        assert served.output is not None
        assert raw(served.output) == raw(expected(keys, tokens))
        served.finish()


def assert_idle(ctl: Any) -> None:
    """Rank 0: its cache idle (``helpers.assert_idle``)."""
    helpers.assert_idle(ctl.cache)


def publish_objects(store: FaultInjectingStore, keys: Sequence[str], tokens: Sequence[int]) -> None:
    """What another encode worker would have published: the encoder's bytes under each key."""
    for key, n in zip(keys, tokens, strict=True):
        store.put_object(key, raw(embedding(key, n)))


# ---------------------------------------------------------------------------- 0.5.23 interface
def misses_then_local_hits(r: Rank) -> None:
    ctl = controller(r, FaultInjectingStore())
    encoder = Encoder()
    keys, tokens = keys_of("m", "abc")
    check(
        r, serve(ctl, r.rank, r.world, "r1", keys, tokens, encoder), keys, tokens, [0] * 3, [0] * 3
    )
    for i, gpu_output in enumerate([False, True]):
        served = serve(
            ctl, r.rank, r.world, f"r{i + 2}", keys, tokens, encoder, gpu_output=gpu_output
        )
        check(r, served, keys, tokens, [1] * 3, [0] * 3)
    mixed, mixed_tokens = keys_of("m", "dab")
    served = serve(ctl, r.rank, r.world, "r4", mixed, mixed_tokens, encoder, gpu_output=True)
    check(r, served, mixed, mixed_tokens, [0, 1, 1], [0, 0, 0])
    assert encoder.calls == [keys, ["m-d"]]
    r.same_on_every_rank(encoder.calls)
    if r.rank == 0:
        assert_idle(ctl)
        s = ctl.cache.stats()
        assert s.entries_by_state == {"READY": 4} and s.publishes_ok == 4, s
        assert s.hits == 3 + 3 + 2, s
        assert not any(ctl.has_local_embedding(k) for k in mixed)
        ctl.close()


def global_hits_from_another_worker(r: Rank) -> None:
    store = FaultInjectingStore()
    keys, tokens = keys_of("g", "abcd")
    publish_objects(store, keys, tokens)
    ctl = controller(r, store)
    encoder = Encoder()
    for i, gpu_output in enumerate([False, True]):
        served = serve(ctl, r.rank, r.world, f"g{i}", keys, tokens, encoder, gpu_output=gpu_output)
        check(r, served, keys, tokens, [1] * 4, [0] * 4)
    assert encoder.calls == []
    if r.rank == 0:
        assert ctl.cache.stats().loads_ok == 4
        assert_idle(ctl)
        ctl.close()


def partial_load_falls_back_per_item(r: Rank) -> None:
    store = FaultInjectingStore()
    keys, tokens = keys_of("p", "abcd")
    faults = [Fault.FAIL, Fault.SHORT, Fault.UNKNOWN, None]
    publish_objects(store, keys, tokens)
    for key, fault in zip(keys, faults, strict=True):
        store.inject(key, fault)
    ctl = controller(r, store)
    encoder = Encoder()
    served = serve(ctl, r.rank, r.world, "p", keys, tokens, encoder)
    check(r, served, keys, tokens, [1] * 4, [1, 1, 1, 0])
    assert encoder.calls == [["p-a", "p-b", "p-c"]]
    r.same_on_every_rank(encoder.calls)
    if r.rank == 0:
        assert_idle(ctl)
        s = ctl.cache.stats()
        assert s.fallbacks_by_reason == {"load_failed": 2, "load_unknown": 1}, s
        # The fallbacks were re-encoded and inserted, except the quarantined one.
        assert s.entries_by_state == {"READY": 3, "QUARANTINED": 1}, s
        assert ctl.cache.fence() == 1
        assert_idle(ctl)
        ctl.close()


def full_pool_falls_back_and_skips_the_insert(r: Rank) -> None:
    store = FaultInjectingStore()
    pool = 1024  # 32 tokens
    blockers, blocker_tokens = ["full-x", "full-y"], [16, 16]
    keys, tokens = ["full-z", "full-w", "full-big"], [8, 4, 40]
    publish_objects(store, keys[:1] + keys[2:], tokens[:1] + tokens[2:])
    ctl = controller(r, store, pool)
    hold = None
    if r.rank == 0:  # another request pins the whole pool
        hold = ctl.cache.request("blocker")
        tensors = [embedding(k, n) for k, n in zip(blockers, blocker_tokens, strict=True)]
        assert hold.insert(blockers, tensors, publish=False) == [True, True]
    encoder = Encoder()
    served = serve(ctl, r.rank, r.world, "full", keys, tokens, encoder)
    check(r, served, keys, tokens, [1, 0, 1], [1, 0, 1])
    assert encoder.calls == [["full-w"], ["full-z", "full-big"]]
    if r.rank == 0:
        assert hold is not None
        hold.close()
        s = ctl.cache.stats()
        # prefetch: full-z no space, full-big too large; store_to_pool_async: all three again
        assert s.misses_by_reason == {"no_space": 3, "too_large": 2}, s
        assert s.entries_by_state == {"READY": 2}, s  # nothing fresh fitted
        assert_idle(ctl)
    # With the pins gone the same request evicts and caches.
    again = serve(ctl, r.rank, r.world, "full2", keys[:2], tokens[:2], encoder)
    check(r, again, keys[:2], tokens[:2], [1, 0], [0, 0])
    if r.rank == 0:
        assert_idle(ctl)
        ctl.close()


def prefetch_timeout_falls_back_and_the_hold_expires(r: Rank) -> None:
    store = FaultInjectingStore()
    keys, tokens = keys_of("t", "ab")
    publish_objects(store, keys, tokens)
    store.inject("t-a", Fault.HOLD)
    ctl = controller(r, store)
    ctl.hold_timeout_s = 0.3
    encoder = Encoder()
    served = serve(ctl, r.rank, r.world, "t", keys, tokens, encoder, prefetch_timeout_s=0.2)
    check(r, served, keys, tokens, [1, 1], [1, 1])
    if r.rank == 0:
        s = ctl.cache.stats()  # the abandoned prefetch still waits on both (one store call)
        assert s.open_requests == 1 and s.entries_by_state == {"LOADING": 2}, s
        time.sleep(0.35)
    more, more_tokens = keys_of("t", "c")
    check(
        r,
        serve(ctl, r.rank, r.world, "t2", more, more_tokens, encoder),
        more,
        more_tokens,
        [0],
        [0],
    )
    if r.rank == 0:
        assert ctl.cache.stats().open_requests == 0  # the next call expired the prefetch
        store.release_holds()
        assert_idle(ctl)
        assert ctl.cache.stats().entries_by_state == {"READY": 3}
        ctl.close()


def all_rank_get_agrees_on_every_rank(r: Rank) -> None:
    """With ``all_rank_get`` every rank polls and the answer is the group's minimum."""
    store = FaultInjectingStore()
    publish_objects(store, ["ag-a"], [3])
    store.inject("ag-a", Fault.HOLD)
    ctl = EmbeddingCacheController(
        store,
        max_pool_size_gb=POOL / GB,
        hidden_dims={Modality.IMAGE: DIM},
        all_rank_get=True,
        dtype=DTYPE,
    )
    if r.rank == 0:
        ctl.prefetch("ag", ["ag-a"], [3], Modality.IMAGE)
    assert not ctl.check_prefetch_progress("ag")  # rank 0's load is held: False everywhere
    if r.rank == 0:
        store.release_holds()
    polls = 1
    while not ctl.check_prefetch_progress("ag"):
        polls += 1
        time.sleep(0.005)
    r.same_on_every_rank(polls)
    if r.rank == 0:
        assert ctl.has_local_embedding("ag-a")
        ctl.release_pool_views(["ag-a"])
        assert_idle(ctl)
        ctl.close()


class AssemblyFailed(RuntimeError):
    """What the replay raises between the fallback mask and the read."""


def failure_before_the_read_expires_the_holds(r: Rank) -> None:
    store = FaultInjectingStore()
    keys, tokens = keys_of("f", "ab")
    ctl = controller(r, store)
    ctl.hold_timeout_s = 0.3
    encoder = Encoder()
    check(r, serve(ctl, r.rank, r.world, "f1", keys, tokens, encoder), keys, tokens, [0, 0], [0, 0])

    def fail() -> None:
        raise AssemblyFailed("the encoder server failed after the fallback mask")

    both, both_tokens = keys_of("f", "abc")
    if r.rank == 0:
        try:
            serve(ctl, 0, r.world, "f2", both, both_tokens, encoder, fail_between=fail)
        except AssemblyFailed:
            pass
        else:
            raise AssertionError("the replay did not fail")
        s = ctl.cache.stats()
        assert s.pinned_entries == 2 and s.entries_by_state.get("LOADING") == 1, s
        time.sleep(0.35)
    else:
        serve(ctl, r.rank, r.world, "f2", both, both_tokens, encoder)
    check(r, serve(ctl, r.rank, r.world, "f3", keys, tokens, encoder), keys, tokens, [1, 1], [0, 0])
    if r.rank == 0:
        assert_idle(ctl)
        assert ctl.cache.entry_state("f-c").name == "ABSENT"  # its reservation was abandoned
        ctl.close()


# ---------------------------------------------------------------------------- older interface
def legacy_misses_hits_global_hits(r: Rank) -> None:
    ctl = legacy(r, FaultInjectingStore())
    encoder = Encoder()
    keys, tokens = keys_of("l", "abc")
    served = serve_legacy(ctl, r.rank, r.world, "l1", keys, tokens, encoder)
    check(r, served, keys, tokens, [0] * 3, [0] * 3)
    served = serve_legacy(ctl, r.rank, r.world, "l2", keys, tokens, encoder)
    check(r, served, keys, tokens, [1] * 3, [0] * 3)
    store = FaultInjectingStore()
    publish_objects(store, keys, tokens)
    other = legacy(r, store)  # a worker that finds them in the global store
    served = serve_legacy(other, r.rank, r.world, "l3", keys, tokens, encoder)
    check(r, served, keys, tokens, [1] * 3, [0] * 3)
    assert encoder.calls == [keys]
    r.same_on_every_rank(encoder.calls)
    if r.rank == 0:
        assert ctl.cache.stats().publishes_ok == 3
        assert other.cache.stats().loads_ok == 3
        for c in (ctl, other):
            assert_idle(c)
            c.close()


def legacy_partial_load_and_full_pool(r: Rank) -> None:
    store = FaultInjectingStore()
    keys, tokens = keys_of("lp", "adc")  # 3, 4 and 2 tokens
    publish_objects(store, keys, tokens)
    store.inject("lp-a", Fault.FAIL)
    ctl = legacy(r, store, pool=512)  # two entries: each takes 256 bytes (the alignment)
    hold = None
    if r.rank == 0:  # another request pins one of them
        hold = ctl.cache.request("blocker")
        assert hold.insert(["lp-x"], [embedding("lp-x", 4)], publish=False) == [True]
    encoder = Encoder()
    served = serve_legacy(ctl, r.rank, r.world, "lp", keys, tokens, encoder)
    # lp-a gets a range and fails to load; lp-d and lp-c find no space while it loads.
    check(r, served, keys, tokens, [1, 1, 1], [1, 1, 1])
    assert encoder.calls == [keys]
    if r.rank == 0:
        assert hold is not None
        hold.close()
        s = ctl.cache.stats()
        assert s.fallbacks_by_reason == {"load_failed": 1}, s
        assert s.misses_by_reason.get("no_space") == 2, s
        # insert_batch cached lp-a in the range its failed load left free; lp-d found none.
        assert s.entries_by_state == {"READY": 2}, s
        assert ctl.get_stats()["num_cached"] == 2
        assert_idle(ctl)
        ctl.close()


SCENARIOS: list[Scenario] = [
    misses_then_local_hits,
    global_hits_from_another_worker,
    partial_load_falls_back_per_item,
    full_pool_falls_back_and_skips_the_insert,
    prefetch_timeout_falls_back_and_the_hold_expires,
    all_rank_get_agrees_on_every_rank,
    failure_before_the_read_expires_the_holds,
    legacy_misses_hits_global_hits,
    legacy_partial_load_and_full_pool,
]
