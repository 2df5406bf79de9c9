"""``EncodePipeline`` across a tensor-parallel group: gloo on CPU, 2 and 3 processes, loopback.

One spawn per group size runs every scenario in order (starting processes costs seconds, a
scenario milliseconds); each rank records per scenario "ok" or its traceback in a JSON file,
and one test per (size, scenario) reports it. Every rank compares its result with a TP=1
pipeline's on the same inputs; rank 0 also checks that its cache is idle afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.errors import RequestError
from embcache.pipeline import TensorParallelError
from embcache.testing import Fault, FaultInjectingStore
from embcache.tools.encoders import TinyViT, synthetic_image
from tests.support import helpers
from tests.support.helpers import raw
from tests.support.rank_scenarios import Rank, report, run_ranks

pytestmark = pytest.mark.timeout(120)

HIDDEN = 12  # divisible by 2 and 3: the sharded encoder splits columns
DTYPE = torch.bfloat16
COLLECTIVE_S = 10.0
SPAWN_DEADLINE_S = 100.0


class EncoderError(RuntimeError):
    """What a failing test encoder raises."""


def expected(n: int) -> torch.Tensor:
    rows = 1 + n % 3
    return (torch.arange(rows * HIDDEN, dtype=torch.float32).view(rows, HIDDEN) / 7 + n).to(DTYPE)


def item(n: int) -> Item:
    return Item(f"img-{n}", (1 + n % 3, HIDDEN), DTYPE)


class ReplicatedEncoder:
    """Every rank computes whole outputs; ``fail_on`` ranks raise instead."""

    def __init__(self, rank: int, fail_on: Sequence[int] = ()) -> None:
        self.device = torch.device("cpu")
        self.rank = rank
        self.fail_on = set(fail_on)
        self.calls: list[list[int]] = []

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        self.calls.append(list(inputs))
        if self.rank in self.fail_on:
            raise EncoderError(f"encoder failed on rank {self.rank}")
        return [expected(n) for n in inputs]


class ShardedEncoder(ReplicatedEncoder):
    """A tensor-parallel encoder: each rank computes its share of the columns, then all-gather.

    It runs a collective per input, so every rank must make exactly the same calls.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(dist.get_rank(group))
        self.group = group
        self.world = dist.get_world_size(group)

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        full = super().__call__(inputs)
        width = HIDDEN // self.world
        outputs = []
        for out in full:
            shard = out[:, self.rank * width : (self.rank + 1) * width].contiguous()
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard, group=self.group)
            outputs.append(torch.cat(parts, dim=1))
        return outputs


def tp_pipeline(
    r: Rank,
    encoder: Any,
    cache: EmbeddingCache | None = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> EncodePipeline:
    """Rank ``r``'s pipeline over the whole group (or ``group``): the cache on rank 0 only."""
    return EncodePipeline(
        cache if r.rank == 0 else None,
        encoder,
        tp_group=group or r.group,
        collective_timeout=kwargs.pop("collective_timeout", COLLECTIVE_S),
        **kwargs,
    )


def tp1(inputs: Sequence[int]) -> torch.Tensor:
    """The TP=1 result: a pipeline of its own, without a group."""
    with EmbeddingCache(1 << 16, pin_memory=False) as cache:
        return EncodePipeline(cache, ReplicatedEncoder(0)).encode(
            "tp1", [item(n) for n in inputs], list(inputs)
        )


def encode(pipeline: EncodePipeline, request_id: str, inputs: Sequence[int]) -> torch.Tensor:
    return pipeline.encode(request_id, [item(n) for n in inputs], list(inputs))


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got, want)


def assert_idle(cache: EmbeddingCache | None) -> None:
    """Rank 0's cache idle (``helpers.assert_idle``); the other ranks have none."""
    if cache is not None:
        helpers.assert_idle(cache)


def make_cache(r: Rank, store: FaultInjectingStore | None = None) -> EmbeddingCache | None:
    return EmbeddingCache(1 << 16, store=store, pin_memory=False) if r.rank == 0 else None


# ---------------------------------------------------------------------------- scenarios
def same_outputs_as_tp1(r: Rank) -> None:
    cache = make_cache(r)
    encoder = ShardedEncoder(r.group)
    pipeline = tp_pipeline(r, encoder, cache)
    for i, inputs in enumerate([[1, 2, 3], [1, 2, 3], [3, 4, 3, 1], [5]]):
        assert_same(encode(pipeline, f"r{i}", inputs), tp1(inputs))
    assert encoder.calls == [[1, 2, 3], [4], [5]]
    r.same_on_every_rank(encoder.calls)
    if cache is not None:
        assert pipeline.stats().local_hits == 3 + 3
        assert_idle(cache)
        cache.close()


def partial_load_failures_on_rank_0(r: Rank) -> None:
    store = FaultInjectingStore()
    faults = {10: Fault.FAIL, 11: Fault.SHORT, 12: Fault.UNKNOWN, 13: None}
    for n, fault in faults.items():
        store.put_object(item(n).key, raw(expected(n)))
        store.inject(item(n).key, fault)
    cache = make_cache(r, store)
    encoder = ShardedEncoder(r.group)
    pipeline = tp_pipeline(r, encoder, cache, prefetch_timeout=COLLECTIVE_S / 2)
    inputs = [13, 10, 11, 12, 13]
    assert_same(encode(pipeline, "r", inputs), tp1(inputs))
    assert encoder.calls == [[10, 11, 12]]
    if cache is not None:
        assert pipeline.stats().fallbacks_by_reason == {"load_failed": 2, "load_unknown": 1}
        assert cache.fence() == 1
        assert_idle(cache)
        cache.close()


def prefetch_timeout_on_rank_0(r: Rank) -> None:
    store = FaultInjectingStore()
    store.put_object(item(50).key, raw(expected(50)))
    store.inject(item(50).key, Fault.HOLD)
    cache = make_cache(r, store)
    pipeline = tp_pipeline(r, ShardedEncoder(r.group), cache, prefetch_timeout=0.2)
    assert_same(encode(pipeline, "r", [50, 51]), tp1([50, 51]))
    if cache is not None:
        assert pipeline.stats().fallbacks_by_reason == {"not_found": 1, "timeout": 1}
        store.release_holds()
        cache.close()  # waits for the held load to end
        assert_idle(cache)


def encoder_exception_on_rank_0_reaches_every_rank(r: Rank) -> None:
    check_encoder_failure(r, failing_rank=0)


def encoder_exception_on_last_rank_reaches_every_rank(r: Rank) -> None:
    check_encoder_failure(r, failing_rank=r.world - 1)


def check_encoder_failure(r: Rank, failing_rank: int) -> None:
    cache = make_cache(r)
    failing = tp_pipeline(r, ReplicatedEncoder(r.rank, fail_on=[failing_rank]), cache)
    started = time.monotonic()
    expected_error = EncoderError if r.rank == failing_rank else TensorParallelError
    with pytest.raises(expected_error) as info:
        encode(failing, "r", [20, 21])
    assert time.monotonic() - started < COLLECTIVE_S / 2, "failure took a timeout to arrive"
    if r.rank != failing_rank:
        assert f"rank {failing_rank}" in str(info.value)
    assert_idle(cache)
    # The group is still aligned: the next call works on every rank.
    working = tp_pipeline(r, ReplicatedEncoder(r.rank), cache)
    assert_same(encode(working, "r2", [20, 21]), tp1([20, 21]))
    if cache is not None:
        assert_idle(cache)
        cache.close()


def rank_0_failure_before_the_mask_reaches_every_rank(r: Rank) -> None:
    cache = make_cache(r)
    pipeline = tp_pipeline(r, ReplicatedEncoder(r.rank), cache)
    expected_error = RequestError if r.rank == 0 else TensorParallelError
    started = time.monotonic()
    with pytest.raises(expected_error):
        if cache is not None:
            with cache.request("taken"):
                encode(pipeline, "taken", [1])  # the request id is already open
        else:
            encode(pipeline, "taken", [1])
    assert time.monotonic() - started < COLLECTIVE_S / 2, "failure took a timeout to arrive"
    assert_same(encode(pipeline, "r", [1]), tp1([1]))
    if cache is not None:
        assert_idle(cache)
        cache.close()


def ranks_called_with_other_items_all_raise(r: Rank) -> None:
    cache = make_cache(r)
    pipeline = tp_pipeline(r, ReplicatedEncoder(r.rank), cache)
    inputs = [1, 2] if r.rank != r.world - 1 else [1, 3]
    with pytest.raises(TensorParallelError, match="other items than rank 0"):
        encode(pipeline, "r", inputs)
    assert_same(encode(pipeline, "r", [1, 2]), tp1([1, 2]))
    if cache is not None:
        assert_idle(cache)
        cache.close()


def tiny_vit_replicated_matches_tp1(r: Rank) -> None:
    encoder = TinyViT(hidden_size=48, width=32, depth=1, heads=2, seed=3)
    images = [synthetic_image(s, h, w) for s, (h, w) in enumerate([(56, 56), (28, 56), (56, 56)])]
    images.append(images[0])
    items = [encoder.item(image) for image in images]
    cache = make_cache(r)
    pipeline = tp_pipeline(r, encoder, cache)
    got = [pipeline.encode(f"r{i}", items, images) for i in range(2)]
    with EmbeddingCache(1 << 20, pin_memory=False) as alone:
        want = EncodePipeline(alone, encoder).encode("tp1", items, images)
    assert want.dtype == torch.bfloat16
    for result in got:
        assert_same(result, want)
    if cache is not None:
        assert_idle(cache)
        cache.close()


def async_twin_matches_tp1(r: Rank) -> None:
    import asyncio

    cache = make_cache(r)
    pipeline = tp_pipeline(r, ShardedEncoder(r.group), cache)
    for i, inputs in enumerate([[6, 7], [7, 8, 6]]):
        got = asyncio.run(pipeline.encode_async(f"a{i}", [item(n) for n in inputs], inputs))
        assert_same(got, tp1(inputs))
    if cache is not None:
        assert_idle(cache)
        cache.close()


def collective_timeout_when_rank_0_never_comes(r: Rank) -> None:
    """Last: the group it times out on is unusable afterwards (a fresh one is used)."""
    group = dist.new_group(backend="gloo")
    if r.rank == 0:
        return  # rank 0 is stuck elsewhere
    pipeline = tp_pipeline(r, ReplicatedEncoder(r.rank), group=group, collective_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="header all_gather failed"):
        encode(pipeline, "r", [1])
    assert time.monotonic() - started < 5.0


SCENARIOS: list[Callable[[Rank], None]] = [
    same_outputs_as_tp1,
    partial_load_failures_on_rank_0,
    prefetch_timeout_on_rank_0,
    encoder_exception_on_rank_0_reaches_every_rank,
    encoder_exception_on_last_rank_reaches_every_rank,
    rank_0_failure_before_the_mask_reaches_every_rank,
    ranks_called_with_other_items_all_raise,
    tiny_vit_replicated_matches_tp1,
    async_twin_matches_tp1,
    collective_timeout_when_rank_0_never_comes,
]
NAMES = [s.__name__ for s in SCENARIOS]


# ---------------------------------------------------------------------------- harness
@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, str]]:
    """Run every scenario on a group of ``param`` processes; rank -> scenario -> outcome."""
    world: int = request.param
    outdir = tmp_path_factory.mktemp(f"tp{world}")
    # Every scenario runs once with poisoned frees (EMBCACHE_POISON): the TP3 group's caches.
    env = {"EMBCACHE_POISON": "1" if world == 3 else "0"}
    outcomes, ended = run_ranks(
        "tests.test_pipeline_tp", outdir, {}, world, SPAWN_DEADLINE_S,
        env=env, timeout_s=30.0, barrier_s=COLLECTIVE_S * 2,
    )  # fmt: skip
    assert ended.in_time, f"TP={world} ranks did not finish in time"
    assert ended.exit_codes == [0] * world, f"TP={world} ranks exited {ended.exit_codes}"
    return outcomes


@pytest.mark.parametrize("scenario", NAMES)
def test_tensor_parallel(outcomes: dict[int, dict[str, str]], scenario: str) -> None:
    report(outcomes, scenario)
