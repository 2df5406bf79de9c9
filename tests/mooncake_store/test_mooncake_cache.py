"""Two ``EmbeddingCache`` workers sharing one real ``mooncake_master`` (loopback TCP, no mocks).

Worker A encodes, inserts and publishes; worker B looks the same keys up, loads them from the
global store into its own pool and must return the very bytes A stored, or fall back per item.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pytest
import torch

from embcache import EmbeddingCache
from embcache.core.lifecycle import ABSENT
from embcache.core.outcomes import Reason, Status
from embcache.driver.item import Item
from tests.support.helpers import assert_idle, mooncake_worker, payload, unique

if TYPE_CHECKING:
    from embcache.store.mooncake_master import MooncakeMaster

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(90)]

CAPACITY = 64 << 20
SEGMENT_BYTES = 256 << 20
WAIT_S = 10.0


@pytest.fixture(scope="module")
def workers(mooncake_master: MooncakeMaster) -> Iterator[tuple[EmbeddingCache, EmbeddingCache]]:
    with ExitStack() as stack:
        a, b = (mooncake_worker(stack, mooncake_master, CAPACITY, SEGMENT_BYTES) for _ in "ab")
        yield a, b


def publish(cache: EmbeddingCache, keys: list[str], tensors: list[torch.Tensor]) -> None:
    """Insert and publish; return once every publish ended OK (bounded)."""
    before = cache.stats().publishes_ok
    with cache.request(unique("publish")) as request:
        assert request.insert(keys, tensors, publish=True) == [True] * len(keys)
    deadline = time.monotonic() + WAIT_S
    while cache.stats().publishes_ok < before + len(keys):
        stats = cache.stats()
        assert stats.publishes_failed == stats.publishes_unknown == 0, stats
        assert time.monotonic() < deadline, "publishes did not finish"
        time.sleep(0.01)


def assert_idle_and_ready(cache: EmbeddingCache) -> None:
    """Idle (``helpers.assert_idle``), and every entry READY: no quarantine."""
    assert_idle(cache)
    stats = cache.stats()
    assert stats.entries_by_state.get("QUARANTINED", 0) == 0
    assert stats.allocated_bytes == stats.bytes_by_state.get("READY", 0)


def same_bytes(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (
        a is not None
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_worker_b_loads_what_worker_a_published(
    workers: tuple[EmbeddingCache, EmbeddingCache], dtype: torch.dtype
) -> None:
    a, b = workers
    shapes = [(1, 8), (576, 1024), (3, 64, 1280), (1024, 3584)]
    tensors = [payload(shape, dtype, seed) for seed, shape in enumerate(shapes)]
    keys = [unique(f"enc-{dtype}") for _ in shapes]
    publish(a, keys, tensors)

    loads_before = b.stats().loads_ok
    items = [Item(k, tuple(t.shape), t.dtype) for k, t in zip(keys, tensors, strict=True)]
    with b.request(unique("read")) as request:
        assert [s.status for s in request.lookup(items)] == [Status.LOADING] * len(items)
        assert request.wait(WAIT_S)
        assert request.fallback_mask().tolist() == [0] * len(items)
        for got, want in zip(request.embeddings(), tensors, strict=True):
            assert same_bytes(got, want)
    assert b.stats().loads_ok == loads_before + len(items)
    with b.request(unique("again")) as request:  # now a plain hit in B's pool
        assert [s.status for s in request.lookup(items)] == [Status.HIT] * len(items)
    assert_idle_and_ready(a)
    assert_idle_and_ready(b)


def test_missing_keys_and_size_mismatches_fall_back_in_one_wait(
    workers: tuple[EmbeddingCache, EmbeddingCache],
) -> None:
    a, b = workers
    good, short, long_, missing = (unique(n) for n in ("good", "short", "long", "missing"))
    stored = {good: (64, 256), short: (32, 256), long_: (128, 256)}
    tensors = {k: payload(shape, torch.float16, i) for i, (k, shape) in enumerate(stored.items())}
    publish(a, list(tensors), list(tensors.values()))

    items = [
        Item(good, (64, 256), torch.float16),
        Item(missing, (64, 256), torch.float16),
        Item(short, (64, 256), torch.float16),  # stored object smaller: a short read
        Item(long_, (64, 256), torch.float16),  # stored object larger: does not fit its range
    ]
    failed_before = b.stats().loads_failed
    with b.request(unique("mixed")) as request:
        statuses = request.lookup(items)
        assert [s.status for s in statuses] == [
            Status.LOADING,
            Status.MISS,
            Status.LOADING,
            Status.LOADING,
        ]
        started = time.monotonic()
        assert request.wait(WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2, "failed items must not wait for a timeout"
        assert request.fallback_mask().tolist() == [0, 1, 1, 1]
        assert request.fallback_reasons() == [
            None,
            Reason.NOT_FOUND,
            Reason.LOAD_FAILED,
            Reason.LOAD_FAILED,
        ]
        views = request.embeddings()
        assert same_bytes(views[0], tensors[good])
        assert views[1:] == [None, None, None]
    assert b.stats().loads_failed == failed_before + 2
    assert b.entry_state(short) is ABSENT and b.entry_state(long_) is ABSENT
    assert_idle_and_ready(b)


def test_concurrent_requests_from_several_threads(
    workers: tuple[EmbeddingCache, EmbeddingCache],
) -> None:
    a, b = workers
    keys = [unique("shared") for _ in range(12)]
    tensors = [payload((256, 512), torch.bfloat16, i) for i in range(len(keys))]
    publish(a, keys, tensors)
    by_key = dict(zip(keys, tensors, strict=True))
    failed_before = b.stats().loads_failed + b.stats().loads_unknown
    errors: list[BaseException] = []

    def serve(thread: int) -> None:
        try:
            for round_ in range(6):
                mine = keys[(thread + round_) % 4 :: 2]  # overlapping sets: single-flight joins
                items = [Item(k, (256, 512), torch.bfloat16) for k in mine]
                with b.request(f"t{thread}-r{round_}-{uuid.uuid4().hex[:6]}") as request:
                    request.lookup(items)
                    assert request.wait(WAIT_S)
                    mask = request.fallback_mask().tolist()
                    for key, view, fell_back in zip(mine, request.embeddings(), mask, strict=True):
                        assert fell_back or same_bytes(view, by_key[key])
                        assert fell_back == (view is None)
                if round_ % 2:
                    b.remove(mine[0])  # force reloads, also while others hold or wait on it
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert b.stats().loads_failed + b.stats().loads_unknown == failed_before
    assert_idle_and_ready(b)


@pytest.mark.timeout(120)
def test_master_killed_mid_batch_of_loads_then_cache_recovers(
    private_mooncake_master: MooncakeMaster,
) -> None:
    master = private_mooncake_master
    with ExitStack() as stack:
        a, b = (mooncake_worker(stack, master, CAPACITY, SEGMENT_BYTES) for _ in "ab")
        keys = [unique("kill") for _ in range(12)]
        tensors = [payload((1024, 1024), torch.float16, i) for i in range(len(keys))]  # 2 MiB
        publish(a, keys, tensors)
        items = [Item(k, (1024, 1024), torch.float16) for k in keys]
        rounds: list[tuple[float, list[int]]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def load_repeatedly() -> None:
            try:
                while not stop.is_set():
                    with b.request(unique("load")) as request:
                        request.lookup(items)
                        started = time.monotonic()
                        assert request.wait(WAIT_S), "a load outlived the request timeout"
                        mask = request.fallback_mask().tolist()
                        views = request.embeddings()
                        for view, want, fell_back in zip(views, tensors, mask, strict=True):
                            assert fell_back == (view is None)
                            assert fell_back or same_bytes(view, want)
                        rounds.append((time.monotonic() - started, mask))
                    b.clear()
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        loader = threading.Thread(target=load_repeatedly)
        loader.start()
        try:
            while len(rounds) < 3 and loader.is_alive():
                time.sleep(0.01)
            master.kill()
            time.sleep(1.0)
        finally:
            stop.set()
            loader.join(timeout=60)
        assert not loader.is_alive(), "a request hung after the master died"
        assert not errors, errors
        assert rounds[0][1] == [0] * len(keys), "before the kill every item is served"
        assert any(sum(mask) for _, mask in rounds), "the master died but nothing fell back"
        assert max(elapsed for elapsed, _ in rounds) < WAIT_S
        b.fence()  # frees anything quarantined by an UNKNOWN outcome
        b.clear()
        assert_idle_and_ready(b)
        assert b.stats().allocated_bytes == 0, "bytes leaked"

        master.start()  # a new master has no objects: publish new keys, then load them
        fresh = [unique("after") for _ in range(4)]
        fresh_tensors = [payload((512, 512), torch.bfloat16, 100 + i) for i in range(4)]
        deadline = time.monotonic() + 30
        while True:
            with a.request(unique("republish")) as request:
                request.insert(fresh, fresh_tensors, publish=True)
            time.sleep(0.2)
            if a.stats().publishes_ok >= len(keys) + len(fresh):
                break
            a.clear()
            assert time.monotonic() < deadline, "worker A never published after the restart"
        fresh_items = [Item(k, (512, 512), torch.bfloat16) for k in fresh]
        while True:
            with b.request(unique("after-restart")) as request:
                request.lookup(fresh_items)
                assert request.wait(WAIT_S)
                if request.fallback_mask().tolist() == [0] * len(fresh):
                    for view, want in zip(request.embeddings(), fresh_tensors, strict=True):
                        assert same_bytes(view, want)
                    break
            b.clear()
            assert time.monotonic() < deadline, "worker B never loaded after the restart"
            time.sleep(0.2)
        assert_idle_and_ready(a)
        assert_idle_and_ready(b)
