"""Issue 25: fences that overlap (a manual ``fence()`` while the cache's own one runs, or two
manual ones) and a key QUARANTINED again between them.

Fence A and fence B both snapshot ``k``; A ends and frees it; ``k`` is loaded again, the load
ends UNKNOWN and ``k`` is QUARANTINED again; then B ends. B's store fence began before that
second transfer, so it does not cover it: B must leave the new entry alone (free the entries it
snapshotted, not their keys). ``LimboStore`` (tests/support/overlap.py) makes the danger real:
an UNKNOWN read lands its bytes only when a store fence that began after it returns, so a range
freed too early is overwritten under whoever got it next, and the byte checks below see it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from embcache import EmbeddingCache, Item, TransferOutcome
from embcache.core.lifecycle import ABSENT, QUARANTINED
from embcache.driver.fencing import FencePolicy
from embcache.driver.locks import HierarchyLock, lock_checking_enabled
from embcache.driver.trace import TraceLog
from embcache.errors import LockOrderError, StoreUnavailableError
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import raw
from tests.support.overlap import (
    GARBAGE,
    UNIT,
    LimboStore,
    item,
    requarantine_between_fences,
    tensor,
)


@pytest.fixture
def limbo() -> Iterator[LimboStore]:
    store = LimboStore()
    store.put_object("k", raw(tensor(0)))
    yield store
    store.open_all()


@pytest.fixture
def cache_on(limbo: LimboStore) -> Iterator[Callable[..., EmbeddingCache]]:
    caches: list[EmbeddingCache] = []

    def make(**kwargs: object) -> EmbeddingCache:
        cache = EmbeddingCache(2 * UNIT, store=limbo, pin_memory=False, **kwargs)  # type: ignore[arg-type]
        caches.append(cache)
        return cache

    yield make
    limbo.open_all()
    for cache in caches:
        cache.close()


# One fence in flight is the cache's own (the fencer thread) or a manual one; the other is manual.
EAGER = FencePolicy(max_fraction=0.0, max_age_s=1e9, min_interval_s=0.01, check_interval_s=0.01)


@pytest.mark.parametrize("first", ["manual", "automatic"])
def test_a_fence_does_not_free_a_key_quarantined_again_after_it_began(
    limbo: LimboStore, cache_on: Callable[..., EmbeddingCache], first: str
) -> None:
    trace = TraceLog()
    cache = cache_on(auto_fence=EAGER if first == "automatic" else None, trace=trace)
    freed = requarantine_between_fences(cache, limbo, manual=first == "manual")
    assert freed == 0, "fence B freed the entry quarantined after it began"
    assert cache.entry_state("k") is QUARANTINED
    cache.check_invariants()

    # The pool has two units and k holds one: only one more entry fits until a fence that
    # began after k's second read frees it, and nothing lands in the bytes it was given.
    with cache.request("fill") as request:
        stored = request.insert(["x", "y"], [tensor(1), tensor(2)], publish=False)
        assert sum(stored) == 1, "the quarantined range was handed out again"
        key = "x" if stored[0] else "y"
        limbo.open_all()  # every fence from now on returns: k's stray read lands now
        cache.fence()  # began after k's second read: covers it, frees k
        assert cache.entry_state("k") is ABSENT
        request.lookup([item(key)])
        view = request.embeddings()[0]
        assert view is not None and torch.equal(view, tensor(1 if key == "x" else 2))
    cache.check_invariants()

    begun = {e["fence"]: e["keys"] for e in trace.events if e["action"] == "BeginFence"}
    ended = {e["fence"]: e["keys"] for e in trace.events if e["action"] == "Fence"}
    assert begun[1] == begun[2] == ["k"] and sorted(ended[1] + ended[2]) == ["k"]


def test_the_stray_read_lands_in_the_range_it_was_given(limbo: LimboStore) -> None:
    """The harness itself: without any quarantine, a stray UNKNOWN read would overwrite bytes
    later given to another key (so the byte check above can fail)."""
    limbo.inject("k", Fault.UNKNOWN)
    pool = torch.zeros(2 * UNIT, dtype=torch.uint8)
    limbo.register_buffer(pool)
    assert limbo.classify(limbo.get_into(["k"], [0], [UNIT])[0]) is TransferOutcome.UNKNOWN
    pool[:UNIT] = torch.frombuffer(bytearray(raw(tensor(3))), dtype=torch.uint8)
    limbo.open_all()
    limbo.fence()
    assert pool[:UNIT].eq(GARBAGE).all()


class FailingFence(FaultInjectingStore):
    """A store whose fence raises while ``fail`` is set (a dead master)."""

    fail = False

    def fence(self) -> None:
        if self.fail:
            raise StoreUnavailableError("the master is gone")
        super().fence()


class FlakySink(TraceLog):
    """A trace sink that raises on the BeginFence event while ``fail`` is set (a full sink)."""

    fail = False

    def append(self, event: dict[str, object], /) -> None:
        if self.fail and event["action"] == "BeginFence":
            raise RuntimeError("the trace sink is full")
        super().append(event)


# why the fence fails -> what it raises
FAILED_FENCES: dict[str, tuple[type[BaseException], str]] = {
    "the store's fence raises": (StoreUnavailableError, "the master is gone"),
    "the lock check refuses it": (LockOrderError, "store fence while holding"),
    "the trace sink raises": (RuntimeError, "trace sink is full"),
}


@pytest.mark.parametrize("why", list(FAILED_FENCES))
def test_a_failed_fence_frees_nothing_and_leaves_no_fence_in_flight(why: str) -> None:
    """A fence that fails raises, and is abandoned: nothing freed, no fence left in flight (a
    snapshot kept would pile one up a second under a dead master), the entry still QUARANTINED;
    the next fence that works frees it. It fails because the store's fence raises, because the
    caller holds a lock (one below the cache's level, so taking the cache lock is allowed but
    the store call is not: refused before the fence begins), or because the trace sink raises
    on the BeginFence event."""
    if why == "the lock check refuses it" and not lock_checking_enabled():
        pytest.skip("needs EMBCACHE_LOCK_CHECK=1")
    store = FailingFence()
    sink = FlakySink() if why == "the trace sink raises" else None
    cache, _ = _quarantined_cache(sink, store)
    error, says = FAILED_FENCES[why]
    try:
        with contextlib.ExitStack() as failing:
            store.fail = why == "the store's fence raises"
            if sink is not None:
                sink.fail = True
            if why == "the lock check refuses it":
                failing.enter_context(HierarchyLock(0, "caller's lock"))
            with pytest.raises(error, match=says):
                cache.fence()
        store.fail = False
        if sink is not None:
            sink.fail = False
        assert cache.sizes()["fences_in_flight"] == 0
        assert cache.entry_state("q") is QUARANTINED
        cache.check_invariants()
        assert cache.fence() == 1
        assert cache.sizes()["fences_in_flight"] == 0
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


def _quarantined_cache(
    trace: object = None, store: FaultInjectingStore | None = None
) -> tuple[EmbeddingCache, FaultInjectingStore]:
    """A cache (no automatic fence) on ``store`` (default: a new one) holding one QUARANTINED
    entry, "q"."""
    store = FaultInjectingStore() if store is None else store
    store.put_object("q", torch.arange(64, dtype=torch.float32).numpy().tobytes())
    store.inject("q", Fault.UNKNOWN)
    cache = EmbeddingCache(
        16 * 256, store=store, pin_memory=False, auto_fence=None, trace=trace  # type: ignore[arg-type]
    )
    with cache.request("r") as r:
        r.lookup([Item("q", (64,), torch.float32)])
        assert r.wait(timeout=10)
    assert cache.entry_state("q") is QUARANTINED
    return cache, store
