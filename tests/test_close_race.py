"""A step that started store transfers, racing ``close()``: the close shuts the I/O pool down
between the step (under the lock) and its hand-off of the transfers (after it), so the pool
refuses them. Nothing started, so each ends FAILED at once: no pin, LOADING entry or publish
is left behind, waiters fall back, the failed write joins the backlog, and the caller gets
``ClosedError`` (before, ``ThreadPoolExecutor``'s RuntimeError, with the entry pinned for a
write that never ran and a load that never ended)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, Item, Status
from embcache.core.lifecycle import READY
from embcache.errors import ClosedError
from embcache.testing import FaultInjectingStore


class ClosingExecutor(ThreadPoolExecutor):
    """An I/O pool that closes ``cache`` (which shuts this pool down) just before it is handed
    its first task of ``trigger``'s name: the window between a step and its hand-off."""

    def __init__(self, trigger: str) -> None:
        super().__init__(max_workers=1)
        self.cache: EmbeddingCache | None = None
        self.trigger = trigger

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if self.cache is not None and getattr(fn, "__name__", "") == self.trigger:
            cache, self.cache = self.cache, None
            cache.close()
        return super().submit(fn, *args, **kwargs)


def closing_cache(trigger: str, store: FaultInjectingStore) -> EmbeddingCache:
    io = ClosingExecutor(trigger)
    cache = EmbeddingCache(1 << 16, store=store, io_executor=io, auto_fence=None)
    io.cache = cache
    return cache


def test_a_publish_handed_off_after_close_ends_failed_and_leaks_no_pin() -> None:
    store = FaultInjectingStore()
    cache = closing_cache("run_publishes", store)
    with pytest.raises(ClosedError, match="none started"):
        cache.insert(["k"], [torch.arange(64, dtype=torch.float32)], publish=True)
    snap = cache.snapshot()
    assert snap.entries["k"].state is READY
    assert not snap.entries["k"].pins and not snap.entries["k"].publishing
    assert store.object("k") is None  # nothing was written
    stats = cache.stats()
    assert stats.publishes_failed == 1 and stats.publish_backlog == 1  # as any failed publish
    cache.check_invariants()


def test_a_load_handed_off_after_close_ends_failed_and_frees_its_range() -> None:
    store = FaultInjectingStore()
    t = torch.arange(64, dtype=torch.float32)
    store.put_object("k", t.numpy().tobytes())
    cache = closing_cache("run_loads", store)
    request = cache.request("r")
    with pytest.raises(ClosedError, match="none started"):
        request.lookup([Item.of("k", t)])
    snap = cache.snapshot()  # the load ended FAILED: its range freed, its waiter let go
    assert "k" not in snap.entries
    assert not (snap.requests["r"].waits or snap.requests["r"].holds)
    cache.check_invariants()
    request.close()  # (the only step a request takes once its cache closed)
    assert not cache.snapshot().requests
    cache.check_invariants()


def test_a_pool_that_refuses_for_another_reason_raises_its_own_error() -> None:
    class Refusing(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            raise OSError("no thread")

    store = FaultInjectingStore()
    cache = EmbeddingCache(1 << 16, store=store, io_executor=Refusing(1), auto_fence=None)
    with pytest.raises(OSError, match="no thread"):
        cache.insert(["k"], [torch.arange(64, dtype=torch.float32)], publish=True)
    entry = cache.snapshot().entries["k"]
    assert entry.state is READY and not entry.pins and not entry.publishing
    assert cache.stats().publish_backlog == 1
    cache.check_invariants()
    assert cache.lookup("r", [Item.of("k", torch.zeros(64))], prefetch=False)[1][0].status is (
        Status.HIT
    )
    cache.close()
