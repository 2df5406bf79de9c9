"""The CUDA paths, side by side with the CPU's: the pinned pool, ``EncodePipeline`` with an
encoder on the GPU, and the SGLang adapter's side-stream copies both ways (CUDA rows staged to
pinned host memory, pool rows copied into CUDA targets, each behind an event).

Each test runs once per device; the ``cuda`` runs are skipped where torch sees no CUDA device
(CI has none: docs/benchmarks.md, "The CUDA paths", says where and when they last ran). The
``cpu`` runs check the tests themselves on every machine. Eviction pressure and threads make
a pool slot freed or reused while a copy still reads or writes it show as wrong bytes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.integrations.sglang import EmbeddingCacheController
from embcache.testing import FaultInjectingStore
from tests.support.helpers import CUDA, DEVICES, assert_idle, publishes_ended, wait_until
from tests.support.sglang_mmencoder import Modality

pytestmark = pytest.mark.timeout(120)

HIDDEN = 1024
DTYPE = torch.bfloat16
IMAGE = Modality.IMAGE


def rows_of(n: int) -> int:
    return 8 + 8 * (n % 4)  # 16-64 KiB an item


def expected(n: int, device: torch.device) -> torch.Tensor:
    """Item ``n``'s rows: distinct per item and per row, made on ``device``."""
    rows = rows_of(n)
    base = torch.arange(rows * HIDDEN, device=device, dtype=torch.float32).view(rows, HIDDEN)
    return ((base % 251) / 8 + n).to(DTYPE)


class DeviceEncoder:
    """Encodes input ``n`` on ``device`` (a GPU kernel where the device is CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.encoded = 0

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        self.encoded += len(inputs)
        return [expected(n, self.device) for n in inputs]


def item(n: int) -> Item:
    return Item(f"img-{n}", (rows_of(n), HIDDEN), DTYPE)


@pytest.mark.parametrize("device", DEVICES)
def test_the_pool_is_pinned_exactly_when_cuda_is_there(device: str) -> None:
    with EmbeddingCache(1 << 20) as cache:
        assert cache.pool.is_pinned() == CUDA
    with EmbeddingCache(1 << 20, pin_memory=False) as cache:
        assert not cache.pool.is_pinned()


@pytest.mark.parametrize("device", DEVICES)
def test_the_pipeline_serves_gpu_outputs_from_the_pool_under_eviction(device: str) -> None:
    """Four threads, 60 requests each of 1-4 items from 24, on a pool of about 10 items: every
    answer equals the encoder's output, on the encoder's device, hits and misses alike."""
    where = torch.device(device)
    encoder = DeviceEncoder(where)
    errors: list[BaseException] = []
    with EmbeddingCache(10 * 40 * HIDDEN * 2) as cache:
        pipeline = EncodePipeline(cache, encoder)

        def serve(thread: int) -> None:
            rng = random.Random(thread)
            try:
                for r in range(60):
                    inputs = [rng.randrange(24) for _ in range(rng.randint(1, 4))]
                    got = pipeline.encode(f"t{thread}-{r}", [item(n) for n in inputs], inputs)
                    assert got.device.type == where.type
                    want = torch.cat([expected(n, where) for n in inputs])
                    assert torch.equal(got, want), f"request t{thread}-{r} {inputs}"
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=serve, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        stats = pipeline.stats()
        assert stats.local_hits > 0 and cache.stats().evictions > 0
        assert stats.encoded == encoder.encoded
        assert_idle(cache)


def controller(store: FaultInjectingStore, items: int) -> EmbeddingCacheController:
    """A controller whose pool holds exactly ``items`` items of 32 rows, under lru (each store
    into the full pool evicts the oldest idle item: the tests count those evictions)."""
    return LruController(
        store,
        max_pool_size_gb=items * 32 * HIDDEN * 2 / (1 << 30),
        hidden_dims={IMAGE: HIDDEN},
        dtype=DTYPE,
    )


class LruController(EmbeddingCacheController):
    """The adapter under lru (its ``cache_policy``; SGLang passes none)."""

    cache_policy = "lru"


def busy(where: torch.device) -> None:
    """On CUDA, keep the current stream busy for about 20 ms, so that a side-stream copy
    ordered after it is still pending when the host goes on: a wait that does not wait, or a
    pin given back before its copy ended, then shows as wrong bytes, not as a lucky race."""
    if where.type == "cuda":
        torch.cuda._sleep(40_000_000)  # GPU clock cycles


def store_rows(ctl: EmbeddingCacheController, keys: list[int], where: torch.device) -> None:
    """MMEncoder's insert: stage the rows (dropped at once, and on CUDA the freed memory
    overwritten, before the wait: the side stream must still copy the original bytes)."""
    busy(where)  # the rows are made after it: the side stream must wait for them
    rows = [expected(n, where) for n in keys]
    handles = ctl.store_to_pool_async([f"img-{n}" for n in keys], rows, IMAGE)
    del rows
    if where.type == "cuda":
        junk = [torch.full((64, HIDDEN), -1.0, device=where, dtype=DTYPE) for _ in keys]
        del junk
    ctl.wait_store_to_pool(handles)
    ctl.insert_batch([f"img-{n}" for n in keys], IMAGE)
    wait_until(lambda: publishes_ended(ctl.cache), "the publishes")  # they pin their entries


@pytest.mark.parametrize("device", DEVICES)
def test_the_adapter_copies_both_ways_on_side_streams_under_eviction(
    device: str, store: FaultInjectingStore
) -> None:  # ``store``: tests/conftest.py's
    """Rows staged from the device, read back into device targets at an offset; after each
    wait the pins go and the next batch evicts and overwrites those slots: a copy that had not
    ended by its wait would show other bytes (``busy`` makes every copy late)."""
    where = torch.device(device)
    ctl = controller(store, items=3)
    try:
        for batch in range(12):
            keys = [24 * batch + 4 * k + 3 for k in range(3)]  # 32 rows each: the pool is full
            store_rows(ctl, keys, where)
            hashes = [f"img-{n}" for n in keys]
            ctl.prefetch(f"r{batch}", hashes, [32] * 3, IMAGE)
            wait_until(lambda b=batch: ctl.check_prefetch_progress(f"r{b}"), "the prefetch")
            busy(where)  # the target is zeroed after it: the copy must wait for that
            target = torch.zeros(5 + 3 * 32, HIDDEN, device=where, dtype=DTYPE)
            handles = [
                ctl.load_to_device_async(h, target, 5 + 32 * k) for k, h in enumerate(hashes)
            ]
            assert None not in handles, "every item is held"
            ctl.wait_load_to_device(handles)  # type: ignore[arg-type]
            # host rows: copied into the pool at once, over the three slots just read
            store_rows(ctl, [keys[k] + 12 for k in range(3)], torch.device("cpu"))
            assert ctl.cache.stats().evictions == 6 * batch + 3  # the three just read
            want = torch.cat(
                [torch.zeros(5, HIDDEN, device=where, dtype=DTYPE)]
                + [expected(n, where) for n in keys]
            )
            assert torch.equal(target, want), f"batch {batch}"
        assert ctl.cache.stats().evictions > 0
        assert_idle(ctl.cache)
    finally:
        ctl.close()
