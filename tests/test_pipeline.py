"""``EncodePipeline`` without tensor parallelism: every path, and nothing leaked after any.

Each test checks the result against the encoder's own output (bytes, dtype, device, order),
which items the encoder saw, the pipeline's counters, and ends with the cache idle: no pins,
no loads, no open requests, exact accounting, invariants hold.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import embcache.pipeline.pipeline as pipeline_module
from embcache import EmbeddingCache, EncodePipeline, Item, PipelineStats
from embcache.core.lifecycle import ABSENT, LOADING, QUARANTINED, READY
from embcache.driver.locks import assert_unlocked
from embcache.errors import InvalidArgumentError, InvalidTypeError, RequestError
from embcache.pipeline.plan import Plan
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import assert_idle, raw, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("poison_modes")]

HIDDEN = 8
DTYPE = torch.bfloat16
WAIT_S = 10.0


class EncoderError(RuntimeError):
    """What a failing test encoder raises."""


class FakeEncoder:
    """Input ``n`` (an int) encodes to ``1 + n % 3`` rows of ``HIDDEN`` values depending on n.

    Records every call; ``gate`` makes calls block until set; ``error`` makes them raise.
    """

    def __init__(self, *, gate: threading.Event | None = None, error: bool = False) -> None:
        self.device = torch.device("cpu")
        self.calls: list[list[int]] = []
        self.entered = threading.Event()
        self.gate = gate
        self.error = error

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        assert_unlocked("test encoder")
        self.calls.append(list(inputs))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), "test gate never opened"
        if self.error:
            raise EncoderError("encoder exploded")
        return [expected(n) for n in inputs]


def expected(n: int) -> torch.Tensor:
    rows = 1 + n % 3
    return (torch.arange(rows * HIDDEN, dtype=torch.float32).view(rows, HIDDEN) / 7 + n).to(DTYPE)


def item(n: int) -> Item:
    return Item(f"img-{n}", (1 + n % 3, HIDDEN), DTYPE)


def reference(inputs: Sequence[int]) -> torch.Tensor:
    return torch.cat([expected(n) for n in inputs])


def encode(pipeline: EncodePipeline, request_id: str, inputs: Sequence[int]) -> torch.Tensor:
    return pipeline.encode(request_id, [item(n) for n in inputs], list(inputs))


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.device == want.device
    assert got.shape == want.shape
    assert torch.equal(got, want)


def counts(stats: PipelineStats) -> tuple[int, int, int]:
    return stats.local_hits, stats.waited, stats.fallback_items


@pytest.fixture
def store() -> FaultInjectingStore:
    return FaultInjectingStore(delay_seconds=0.05)


@pytest.fixture
def cache(store: FaultInjectingStore) -> Iterator[EmbeddingCache]:
    with EmbeddingCache(1 << 16, store=store, pin_memory=False) as c:
        yield c
        assert_idle(c)


# ---------------------------------------------------------------------------- paths
def test_all_misses_then_all_hits(cache: EmbeddingCache, store: FaultInjectingStore) -> None:
    encoder = FakeEncoder()
    pipeline = EncodePipeline(cache, encoder)
    inputs = [1, 2, 3]
    assert_same(encode(pipeline, "r1", inputs), reference(inputs))
    assert encoder.calls == [[1, 2, 3]]
    assert counts(pipeline.stats()) == (0, 0, 3)
    assert pipeline.stats().fallbacks_by_reason == {"not_found": 3}
    assert [cache.entry_state(item(n).key) for n in inputs] == [READY] * 3

    assert_same(encode(pipeline, "r2", inputs), reference(inputs))
    assert encoder.calls == [[1, 2, 3]], "hits must not reach the encoder"
    stats = pipeline.stats()
    assert counts(stats) == (3, 0, 3)
    assert (stats.calls, stats.items, stats.encoded, stats.encoder_calls) == (2, 6, 3, 1)
    assert_idle(cache)
    assert all(store.object(item(n).key) == raw(expected(n)) for n in inputs), "published"


def test_store_hits_are_loaded_not_encoded(store: FaultInjectingStore) -> None:
    for n in (4, 5):
        store.put_object(item(n).key, raw(expected(n)))
    with EmbeddingCache(1 << 16, store=store, pin_memory=False) as cache:
        encoder = FakeEncoder()
        pipeline = EncodePipeline(cache, encoder)
        assert_same(encode(pipeline, "r", [4, 6, 5]), reference([4, 6, 5]))
        assert encoder.calls == [[6]]
        assert counts(pipeline.stats()) == (0, 2, 1)
        assert cache.stats().loads_ok == 2
        assert_idle(cache)


def test_duplicate_keys_are_encoded_once_and_kept_in_order(cache: EmbeddingCache) -> None:
    encoder = FakeEncoder()
    pipeline = EncodePipeline(cache, encoder)
    encode(pipeline, "warm", [7])
    inputs = [8, 7, 8, 9, 7]
    assert_same(encode(pipeline, "r", inputs), reference(inputs))
    assert encoder.calls == [[7], [8, 9]]
    assert counts(pipeline.stats()) == (2, 0, 1 + 3)


def test_partial_load_failures_fall_back_per_item(store: FaultInjectingStore) -> None:
    faults = {10: Fault.FAIL, 11: Fault.SHORT, 12: Fault.UNKNOWN, 13: None}
    for n, fault in faults.items():
        store.put_object(item(n).key, raw(expected(n)))
        store.inject(item(n).key, fault)
    with EmbeddingCache(1 << 16, store=store, pin_memory=False) as cache:
        encoder = FakeEncoder()
        pipeline = EncodePipeline(cache, encoder, prefetch_timeout=WAIT_S)
        started = time.monotonic()
        assert_same(encode(pipeline, "r", list(faults)), reference(list(faults)))
        assert time.monotonic() - started < WAIT_S / 2, "a failed item must not wait a timeout"
        assert encoder.calls == [[10, 11, 12]]
        stats = pipeline.stats()
        assert stats.fallbacks_by_reason == {"load_failed": 2, "load_unknown": 1}
        assert counts(stats) == (0, 1, 3)
        # The failed ones were re-inserted; the UNKNOWN one waits for a fence.
        states = [cache.entry_state(item(n).key) for n in faults]
        assert states == [READY, READY, QUARANTINED, READY]
        assert cache.fence() == 1
        assert cache.entry_state(item(12).key) is ABSENT
        assert_idle(cache)


def test_encoder_exception_releases_everything(cache: EmbeddingCache) -> None:
    pipeline = EncodePipeline(cache, FakeEncoder(error=True))
    encode(EncodePipeline(cache, FakeEncoder()), "warm", [20])
    with pytest.raises(EncoderError):
        encode(pipeline, "r", [20, 21, 22])
    assert_idle(cache)
    assert cache.entry_state(item(21).key) is ABSENT, "the reservation ended"
    assert cache.entry_state(item(20).key) is READY
    assert pipeline.stats().failed_calls == 1
    good = EncodePipeline(cache, FakeEncoder())
    assert_same(encode(good, "r", [20, 21, 22]), reference([20, 21, 22]))


def test_encoder_exception_makes_waiters_encode_themselves(cache: EmbeddingCache) -> None:
    gate = threading.Event()
    failing = FakeEncoder(gate=gate, error=True)
    errors: list[BaseException] = []

    def run_failing() -> None:
        try:
            encode(EncodePipeline(cache, failing), "a", [30])
        except EncoderError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run_failing)
    thread.start()
    assert failing.entered.wait(WAIT_S)
    assert cache.entry_state(item(30).key) is LOADING
    waiter = FakeEncoder()
    pipeline = EncodePipeline(cache, waiter, prefetch_timeout=WAIT_S)
    result: list[torch.Tensor] = []
    joiner = threading.Thread(target=lambda: result.append(encode(pipeline, "b", [30, 31])))
    joiner.start()
    wait_until(lambda: cache.stats().single_flight_joins >= 1)
    gate.set()
    thread.join(WAIT_S)
    joiner.join(WAIT_S)
    assert len(errors) == 1 and len(result) == 1
    assert_same(result[0], reference([30, 31]))
    assert waiter.calls == [[30, 31]]
    assert pipeline.stats().fallbacks_by_reason == {"abandoned": 1, "not_found": 1}


def test_encoder_output_that_disagrees_with_its_item_is_refused(cache: EmbeddingCache) -> None:
    class Promoting(FakeEncoder):
        def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
            return [t.float() for t in super().__call__(inputs)]

    with pytest.raises(InvalidArgumentError, match=r"torch\.float32.*never converts"):
        encode(EncodePipeline(cache, Promoting()), "r", [40])

    class Short(FakeEncoder):
        def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
            return super().__call__(inputs)[1:]

    with pytest.raises(InvalidArgumentError, match="one per input"):
        encode(EncodePipeline(cache, Short()), "r", [40, 41])
    assert_idle(cache)
    assert cache.entry_state(item(40).key) is ABSENT


def test_prefetch_timeout_encodes_instead(store: FaultInjectingStore) -> None:
    store.put_object(item(50).key, raw(expected(50)))
    store.inject(item(50).key, Fault.HOLD)
    with EmbeddingCache(1 << 16, store=store, pin_memory=False) as cache:
        encoder = FakeEncoder()
        pipeline = EncodePipeline(cache, encoder, prefetch_timeout=0.2)
        started = time.monotonic()
        assert_same(encode(pipeline, "r", [50, 51]), reference([50, 51]))
        assert 0.2 <= time.monotonic() - started < WAIT_S
        assert encoder.calls == [[50, 51]]
        assert pipeline.stats().fallbacks_by_reason == {"timeout": 1, "not_found": 1}
        assert cache.entry_state(item(50).key) is LOADING, "the load is still in flight"
        store.release_holds()
        wait_until(lambda: cache.entry_state(item(50).key) is READY)
        assert_idle(cache)


def test_no_space_falls_back_and_serves_the_encoder_output() -> None:
    with EmbeddingCache(256, pin_memory=False) as cache:  # holds one 2-row bf16 item at most
        encoder = FakeEncoder()
        pipeline = EncodePipeline(cache, encoder)
        inputs = [60, 61, 62]  # 1, 2 and 3 rows of 16 bytes
        assert_same(encode(pipeline, "r", inputs), reference(inputs))
        assert sum(pipeline.stats().fallbacks_by_reason.values()) == 3
        assert_idle(cache)


def test_single_flight_between_two_pipelines(cache: EmbeddingCache) -> None:
    gate = threading.Event()
    first = FakeEncoder(gate=gate)
    second = FakeEncoder()
    results: dict[str, torch.Tensor] = {}

    def run(name: str, pipeline: EncodePipeline, inputs: list[int]) -> None:
        results[name] = encode(pipeline, name, inputs)

    a = threading.Thread(target=run, args=("a", EncodePipeline(cache, first), [70, 71]))
    a.start()
    assert first.entered.wait(WAIT_S)
    p2 = EncodePipeline(cache, second, prefetch_timeout=WAIT_S)
    b = threading.Thread(target=run, args=("b", p2, [71, 72]))
    b.start()
    wait_until(lambda: cache.stats().single_flight_joins >= 1)
    assert second.calls == [], "b waits for a's encode of 71"
    time.sleep(0.05)  # b's wait lasts at least this
    gate.set()
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert_same(results["a"], reference([70, 71]))
    assert_same(results["b"], reference([71, 72]))
    assert first.calls == [[70, 71]]
    assert second.calls == [[72]], "71 was encoded once, by a"
    assert counts(p2.stats()) == (0, 1, 1)
    assert 0.05 <= p2.stats().wait_seconds < WAIT_S, "b's wait for a's encode is timed"


def test_concurrent_calls_with_eviction_stay_correct() -> None:
    with EmbeddingCache(512, alignment=16, pin_memory=False) as cache:
        pipeline = EncodePipeline(cache, FakeEncoder(), prefetch_timeout=WAIT_S)
        failures: list[str] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for i in range(25):
                inputs = [int(rng.paretovariate(0.7)) % 60 for _ in range(rng.randint(1, 4))]
                got = encode(pipeline, f"w{seed}-{i}", inputs)
                if not torch.equal(got, reference(inputs)):
                    failures.append(f"{seed}/{i}: {inputs}")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 3)
        assert failures == []
        stats = pipeline.stats()
        assert stats.items == stats.local_hits + stats.waited + stats.fallback_items
        assert cache.stats().evictions > 0
        assert_idle(cache)


# ---------------------------------------------------------------------------- asyncio
def test_encode_async_matches_encode(store: FaultInjectingStore) -> None:
    store.put_object(item(80).key, raw(expected(80)))
    store.inject(item(80).key, Fault.DELAY)
    with EmbeddingCache(1 << 16, store=store, pin_memory=False) as cache:
        encoder = FakeEncoder()
        pipeline = EncodePipeline(cache, encoder)

        async def main() -> list[torch.Tensor]:
            return list(
                await asyncio.gather(
                    pipeline.encode_async("a", [item(n) for n in (80, 81)], [80, 81]),
                    pipeline.encode_async("b", [item(n) for n in (81, 82)], [81, 82]),
                )
            )

        first, second = asyncio.run(main())
        assert_same(first, reference([80, 81]))
        assert_same(second, reference([81, 82]))
        assert sorted(n for call in encoder.calls for n in call) in ([81, 82], [81, 81, 82])
        assert_idle(cache)


def test_encode_async_cancelled_mid_encode_leaks_nothing(cache: EmbeddingCache) -> None:
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    pipeline = EncodePipeline(cache, encoder)

    async def main() -> None:
        task = asyncio.create_task(pipeline.encode_async("r", [item(90)], [90]))
        while not encoder.entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done(), "the cancellation waits for the running encoder call"
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert pipeline.stats().failed_calls == 1
    assert_idle(cache)


def test_encode_async_encoder_exception_leaks_nothing(cache: EmbeddingCache) -> None:
    pipeline = EncodePipeline(cache, FakeEncoder(error=True))
    with pytest.raises(EncoderError):
        asyncio.run(pipeline.encode_async("r", [item(95)], [95]))
    assert cache.entry_state(item(95).key) is ABSENT
    assert_idle(cache)


# ---------------------------------------------------------------------------- bad input
def test_bad_calls_raise_and_leak_nothing(cache: EmbeddingCache) -> None:
    pipeline = EncodePipeline(cache, FakeEncoder())
    with pytest.raises(InvalidArgumentError, match="at least one item"):
        pipeline.encode("r", [], [])
    with pytest.raises(InvalidArgumentError, match="one input per item"):
        pipeline.encode("r", [item(1), item(2)], [1])
    with pytest.raises(InvalidArgumentError, match="share the dtype"):
        pipeline.encode("r", [item(1), Item("x", (1, HIDDEN), torch.float16)], [1, 2])
    with pytest.raises(InvalidArgumentError, match="one key names one embedding"):
        pipeline.encode("r", [item(1), Item(item(1).key, (5, HIDDEN), DTYPE)], [1, 1])
    with pytest.raises(InvalidTypeError):
        pipeline.encode("r", item(1), [1])  # type: ignore[arg-type]
    with cache.request("busy"), pytest.raises(RequestError):
        encode(pipeline, "busy", [1])
    assert pipeline.stats().failed_calls == 6
    assert_idle(cache)


def test_bad_construction_is_refused(cache: EmbeddingCache) -> None:
    with pytest.raises(InvalidTypeError, match="rank 0 needs an EmbeddingCache"):
        EncodePipeline(None, FakeEncoder())
    with pytest.raises(InvalidTypeError, match=r"torch\.device"):
        EncodePipeline(cache, lambda inputs: [])  # type: ignore[arg-type]
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="prefetch_timeout"):
            EncodePipeline(cache, FakeEncoder(), prefetch_timeout=bad)
    with pytest.raises(InvalidArgumentError, match="collective_timeout"):
        EncodePipeline(cache, FakeEncoder(), collective_timeout=0)


# ---------------------------------------------------------------------------- helpers
# ---------------------------------------------------------------------------- cache API report
def test_cache_reports_a_reason_for_every_item_it_does_not_serve(cache: EmbeddingCache) -> None:
    with cache.request("r") as request:
        request.lookup([item(1)], reserve_misses=True)
        assert request.fallback_mask().tolist() == [1]
        assert request.fallback_reasons() != [None]


@pytest.mark.parametrize("then", [[3, 1, 2], [3, 9, 1, 10, 2]], ids=["all hit", "hits and misses"])
def test_each_byte_of_the_answer_is_copied_once(
    cache: EmbeddingCache, monkeypatch: pytest.MonkeyPatch, then: list[int]
) -> None:
    """Held rows go from the pool straight into their place in the answer, fresh outputs too:
    the bytes the pipeline copies (``copy_``, ``torch.cat``, its byte copies to addresses
    outside the pool; the pool's own copy-in is a byte copy into the pool) are exactly the
    answer's. On the CPU they all go as bytes: no ``copy_`` (its dispatch) at all."""
    pipeline = EncodePipeline(cache, FakeEncoder())
    encode(pipeline, "r1", [1, 2, 3])
    copied: list[int] = []
    dispatched: list[int] = []
    cat, copy, copy_bytes = torch.cat, torch.Tensor.copy_, pipeline_module.copy_bytes
    pool_start = cache.pool.data_ptr()
    pool_end = pool_start + cache.pool.nbytes

    def counted_cat(tensors: Sequence[torch.Tensor], *args: object, **kw: object) -> torch.Tensor:
        copied.append(sum(t.nbytes for t in tensors))
        return cat(tensors, *args, **kw)  # type: ignore[arg-type]

    def counted_copy(dst: torch.Tensor, src: torch.Tensor, *args: object) -> torch.Tensor:
        copied.append(src.nbytes)
        dispatched.append(src.nbytes)
        return copy(dst, src, *args)  # type: ignore[arg-type]

    def counted_bytes(dst: int, src: int, nbytes: int) -> None:
        if not pool_start <= dst < pool_end:
            copied.append(nbytes)
        copy_bytes(dst, src, nbytes)

    monkeypatch.setattr(torch, "cat", counted_cat)
    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    monkeypatch.setattr(pipeline_module, "copy_bytes", counted_bytes)
    got = encode(pipeline, "r2", then)
    monkeypatch.undo()
    assert_same(got, reference(then))
    assert sum(copied) == got.nbytes, "every byte of the answer copied once"
    assert dispatched == [], "on the CPU each row goes as bytes, with no copy_ dispatch"
    cache.remove("img-1")  # the answer is no view of the pool: it outlives the entry
    assert_same(got, reference(then))


# ---------------------------------------------------------------------------- on_insert
def test_on_insert_sees_each_insert_of_fresh_outputs(cache: EmbeddingCache) -> None:
    seen: list[tuple[int, float]] = []

    def observe(items: int, seconds: float) -> None:
        assert_unlocked("on_insert")
        seen.append((items, seconds))

    pipeline = EncodePipeline(cache, FakeEncoder(), on_insert=observe)
    assert_same(encode(pipeline, "r1", [1, 2, 2]), reference([1, 2, 2]))  # 2 keys encoded
    assert [items for items, _ in seen] == [2]
    assert 0 < seen[0][1] < WAIT_S
    assert_same(encode(pipeline, "r2", [1, 2]), reference([1, 2]))  # all hits: no insert
    assert len(seen) == 1


def test_a_raising_on_insert_is_logged_and_the_call_goes_on(
    cache: EmbeddingCache, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(items: int, seconds: float) -> None:
        raise RuntimeError("metrics backend down")

    pipeline = EncodePipeline(cache, FakeEncoder(), on_insert=explode)
    assert_same(encode(pipeline, "r1", [4]), reference([4]))
    assert "on_insert raised" in caplog.text and "metrics backend down" in caplog.text
    assert cache.entry_state("img-4") is READY


def test_on_insert_must_be_callable(cache: EmbeddingCache) -> None:
    with pytest.raises(InvalidTypeError, match="on_insert must be callable"):
        EncodePipeline(cache, FakeEncoder(), on_insert=42)  # type: ignore[arg-type]


def test_a_call_without_a_group_computes_no_fingerprint(
    cache: EmbeddingCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only ranks of a tensor-parallel group compare fingerprints: a lone rank skips the
    digest of every item on its request path."""

    def refuse(plan: Plan) -> int:
        raise AssertionError("fingerprint computed without a group")

    monkeypatch.setattr(Plan, "fingerprint", refuse)
    pipeline = EncodePipeline(cache, FakeEncoder())
    assert_same(encode(pipeline, "r1", [1, 2]), reference([1, 2]))
    assert_same(encode(pipeline, "r2", [2, 1, 4]), reference([2, 1, 4]))
