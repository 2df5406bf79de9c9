"""The lock-order checker of ``embcache.driver.locks`` catches every kind of violation DESIGN.md
names.

Each violation is provoked on purpose against a real cache: an acquisition against the
hierarchy (allocator lock, then cache lock), a re-entrant acquisition, and blocking work (a
store call, a payload copy, a wait, a wake-up) under the cache lock. With checking on each
raises ``LockOrderError`` naming the locks and what to do; with checking off nothing is raised
(except the re-entrant case, which would deadlock a plain lock and is not run). A scripted
normal flow gives the same statuses, bytes, stats and trace with checking on and off.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, Item, TransferOutcome
from embcache.core.lifecycle import QUARANTINED, READY
from embcache.driver.allocator import RangeAllocator
from embcache.driver.locks import (
    HierarchyLock,
    assert_unlocked,
    enable_lock_checking,
    lock_checking_enabled,
)
from embcache.driver.pool import PoolViews
from embcache.errors import LockOrderError
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import raw, wait_until

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


class ProbeStore(FaultInjectingStore):
    """An ``FaultInjectingStore`` that checks, in every call, that its caller holds no lock."""

    def __init__(self) -> None:
        super().__init__(delay_seconds=0.001)
        self.probed: list[str] = []

    def _probe(self, what: str) -> None:
        assert_unlocked(f"store {what}")
        self.probed.append(what)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._probe("exists")
        return super().exists(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._probe("get_into")
        return super().get_into(keys, offsets, sizes)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._probe("put_from")
        return super().put_from(keys, offsets, sizes)

    def fence(self) -> None:
        self._probe("fence")
        super().fence()


@pytest.fixture
def checking() -> Iterator[None]:
    """Lock checking on for this test (whatever EMBCACHE_LOCK_CHECK says), restored after."""
    was = lock_checking_enabled()
    enable_lock_checking(True)
    yield
    enable_lock_checking(was)


@pytest.fixture
def unchecked() -> Iterator[None]:
    """Lock checking off for this test, restored after (toggled with no lock held)."""
    was = lock_checking_enabled()
    enable_lock_checking(False)
    yield
    enable_lock_checking(was)


@pytest.fixture
def allocator() -> RangeAllocator:
    """A public allocator: its lock is level 2, the one the hierarchy puts under the cache lock
    (the cache's own core uses an allocator without a lock)."""
    return RangeAllocator(1 << 16)


@pytest.fixture
def cache() -> Iterator[EmbeddingCache]:
    c = EmbeddingCache(1 << 16, store=ProbeStore(), pin_memory=False, io_workers=2)
    yield c
    c.close()


def cache_lock(cache: EmbeddingCache) -> HierarchyLock:
    """The cache's own lock: a test holds it as a bug inside the driver would."""
    return cache.runner.lock  # (a HierarchyLock: the tests turn checking on first)


def copy_nothing(cache: EmbeddingCache) -> None:
    """The payload copy's own lock-order guard, run on no copies."""
    PoolViews(cache.pool).copy_in([])  # the payload copy's own guard, over the cache's pool


def allocator_lock(allocator: RangeAllocator) -> HierarchyLock:
    """The allocator's own lock (level 2), which only its methods take."""
    return allocator.lock


def tensor(seed: int, n: int = 256) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32) * 7919 + seed


def assert_usable(cache: EmbeddingCache) -> None:
    """After a caught violation: this thread holds nothing, and the cache still works."""
    assert_unlocked("checking that a violation left no lock behind")
    assert not cache_lock(cache).locked()
    with cache.request("after") as request:
        assert request.insert(["after"], [tensor(1)], publish=False) == [True]
        assert [s.status.name for s in request.lookup([Item("after", (256,), torch.int32)])] == [
            "HIT"
        ]
        view = request.embeddings()[0]
        assert view is not None and torch.equal(view, tensor(1))
    cache.check_invariants()
    assert cache.stats().pinned_entries == 0


# ---------------------------------------------------------------------------- checking on
def test_allocator_lock_then_cache_lock_is_refused(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    with allocator_lock(allocator), pytest.raises(LockOrderError) as caught:
        cache_lock(cache).acquire()
    message = str(caught.value)
    assert "taking cache lock (level 1) while holding allocator lock (level 2)" in message
    assert "increasing level order" in message
    assert not cache_lock(cache).locked(), "a refused acquisition must not take the lock"
    assert_usable(cache)


def test_cache_method_called_while_holding_the_allocator_lock_is_refused(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    """The same inversion through the public API: a cache call from under the allocator lock."""
    with allocator_lock(allocator), pytest.raises(LockOrderError, match="while holding allocator"):
        cache.stats()
    assert_usable(cache)


def test_cache_lock_then_allocator_lock_is_the_allowed_order(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    with cache_lock(cache):
        assert allocator.allocate(256) == 0  # takes level 2 under level 1
        allocator.free(0)
    assert_usable(cache)


@pytest.mark.parametrize("which", ["cache", "allocator"])
def test_reentrant_acquisition_is_refused(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator, which: str
) -> None:
    lock = cache_lock(cache) if which == "cache" else allocator_lock(allocator)
    with lock, pytest.raises(LockOrderError) as caught:
        lock.acquire()
    level = 1 if which == "cache" else 2
    assert f"taking {which} lock (level {level}) while holding {which} lock (level {level})" in str(
        caught.value
    )
    assert_usable(cache)


def test_reentrant_cache_call_from_under_the_cache_lock_is_refused(
    checking: None, cache: EmbeddingCache
) -> None:
    """A controller bug that calls a public method while holding its own lock is a loud error,
    not a silent deadlock."""
    with cache_lock(cache), pytest.raises(LockOrderError, match="while holding cache lock"):
        cache.remove("k")
    assert_usable(cache)


def test_allocator_call_under_its_own_lock_is_refused(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    with allocator_lock(allocator), pytest.raises(LockOrderError, match="allocator lock"):
        allocator.allocate(256)
    assert allocator.allocated_bytes == 0
    assert_usable(cache)


def test_store_call_under_the_cache_lock_is_refused(checking: None, cache: EmbeddingCache) -> None:
    store = cache.store
    assert isinstance(store, ProbeStore)
    store.put_object("k", raw(tensor(3)))
    with cache_lock(cache):
        with pytest.raises(LockOrderError) as caught:
            store.get_into(["k"], [0], [1024])
        with pytest.raises(LockOrderError, match="store put_from while holding cache lock"):
            store.put_from(["k"], [0], [1024])
        with pytest.raises(LockOrderError, match="store exists while holding cache lock"):
            store.exists(["k"])
    assert str(caught.value) == (
        "store get_into while holding cache lock: release every lock first"
    )
    assert store.calls["get_into"] == store.calls["put_from"] == store.calls["exists"] == 0
    assert_usable(cache)


def test_store_call_under_the_allocator_lock_names_both_held_locks(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    with cache_lock(cache), allocator_lock(allocator), pytest.raises(LockOrderError) as caught:
        cache.store.fence()
    assert "store fence while holding cache lock, allocator lock" in str(caught.value)
    assert_usable(cache)


def test_payload_copy_under_the_cache_lock_is_refused(
    checking: None, cache: EmbeddingCache
) -> None:
    refused = pytest.raises(LockOrderError, match="payload copy while holding cache lock")
    with cache_lock(cache), refused:
        copy_nothing(cache)  # an insert would be refused at the lock first
    assert_usable(cache)


def test_wait_under_the_cache_lock_is_refused(checking: None, cache: EmbeddingCache) -> None:
    with cache.request("waiter") as request:
        with (
            cache_lock(cache),
            pytest.raises(LockOrderError, match="request wait while holding cache lock"),
        ):
            request.wait(0.0)
        assert request.wait(0.0)  # without the lock the same wait is fine
    assert_usable(cache)


def test_wake_up_under_the_cache_lock_is_refused(checking: None, cache: EmbeddingCache) -> None:
    """A step that wakes a waiting request (a fill ending) called by a thread that holds a
    lock: the funnel takes the cache lock itself, and refuses to wake anyone once it left it."""
    item = Item("w", (256,), torch.int32)
    filler, waiter = cache.request("filler"), cache.request("waiter")
    assert filler.begin_fill([item]) != [None]
    assert [s.status.name for s in waiter.lookup([item], prefetch=False)] == ["LOADING"]
    outer = HierarchyLock(0, "test outer lock")
    with outer, pytest.raises(LockOrderError, match="waking requests while holding test outer"):
        filler.end_fill(["w"], [TransferOutcome.OK], publish=False)
    waiter.close()
    filler.close()
    assert_usable(cache)


def test_store_that_takes_the_cache_lock_is_refused_when_called_under_it(
    checking: None,
) -> None:
    """A store that calls back into the cache (here: ``stats()``) is fine from the I/O thread,
    which holds nothing, and refused if the controller ever called it under the lock."""

    class CallbackStore(FaultInjectingStore):
        def __init__(self) -> None:
            super().__init__()
            self.cache: EmbeddingCache | None = None
            self.seen: list[int] = []

        def get_into(
            self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
        ) -> list[int]:
            assert self.cache is not None
            self.seen.append(self.cache.stats().entries_by_state.get("LOADING", 0))
            return super().get_into(keys, offsets, sizes)

    store = CallbackStore()
    with EmbeddingCache(1 << 16, store=store, pin_memory=False) as cache:
        store.cache = cache
        store.put_object("k", raw(tensor(5)))
        item = Item("k", (256,), torch.int32)
        with cache.request("loader") as request:
            assert [s.status.name for s in request.lookup([item])] == ["LOADING"]
            assert request.wait(WAIT_S)
            view = request.embeddings()[0]
            assert view is not None and torch.equal(view, tensor(5))
        assert store.seen == [1]
        with cache_lock(cache), pytest.raises(LockOrderError, match="taking cache lock"):
            store.get_into(["k"], [0], [1024])
        assert_usable(cache)


def test_checker_is_per_thread(
    checking: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    """Another thread holding the cache lock does not make this thread's blocking work illegal,
    and a violation in one thread leaves the others' bookkeeping alone."""
    held = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:
        try:
            with cache_lock(cache):
                held.set()
                assert release.wait(WAIT_S)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(WAIT_S)
        assert_unlocked("store call in another thread")  # nothing raised: this thread holds none
        with pytest.raises(LockOrderError), allocator_lock(allocator):
            assert_unlocked("copy")
    finally:
        release.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    assert_usable(cache)


def test_store_probes_run_with_no_lock_in_every_normal_flow(
    checking: None, cache: EmbeddingCache
) -> None:
    """Every store call the controller makes passes the probe: exists, get_into, put_from, and
    fence all ran, and none raised (a raise would have failed the load or publish)."""
    store = cache.store
    assert isinstance(store, ProbeStore)
    store.put_object("stored", raw(tensor(9)))
    with cache.request("r") as request:
        request.lookup([Item("stored", (256,), torch.int32)])
        assert request.wait(WAIT_S)
        assert request.fallback_mask().tolist() == [0]
        assert request.insert(["fresh"], [tensor(10)], publish=True) == [True]
    wait_until(lambda: cache.stats().publishes_ok == 1, "the publish")
    cache.fence()
    assert set(store.probed) == {"exists", "get_into", "put_from", "fence"}
    assert cache.stats().loads_unknown == cache.stats().publishes_unknown == 0


# ---------------------------------------------------------------------------- checking off
def test_with_checking_off_violations_raise_nothing(
    unchecked: None, cache: EmbeddingCache, allocator: RangeAllocator
) -> None:
    store = cache.store
    assert isinstance(store, ProbeStore)
    with allocator_lock(allocator):
        cache_lock(cache).acquire()  # inverted, but only one thread: no deadlock
        cache_lock(cache).release()
    with cache_lock(cache):
        assert_unlocked("anything")
        store.exists(["k"])
        store.get_into([], [], [])
        copy_nothing(cache)  # not a step: it takes the cache lock, and would deadlock
    with cache.request("waiter") as request, cache_lock(cache):
        assert request.wait(0.0)
    assert_usable(cache)


# ---------------------------------------------------------------------------- same behaviour
def scripted_flow() -> dict[str, Any]:
    """One normal run touching every action; each asynchronous step is awaited, so the trace
    is deterministic. Returns everything observable."""
    trace: list[dict[str, Any]] = []
    store = FaultInjectingStore(delay_seconds=0.001)
    observed: list[Any] = []
    unit = (256,)
    with EmbeddingCache(  # lru: its fills evict in LRU order (below)
        4 * 1024, store=store, pin_memory=False, io_workers=2, trace=trace, policy="lru"
    ) as cache:
        store.put_object("stored", raw(tensor(1)))
        store.put_object("broken", raw(tensor(2)))
        store.inject("broken", Fault.UNKNOWN)
        with cache.request("a") as a:
            observed.append(
                a.lookup(
                    [Item(k, unit, torch.int32) for k in ("stored", "broken", "reserved")],
                    reserve_misses=True,
                )
            )
            assert a.wait(WAIT_S)
            with cache.request("b") as b:
                observed.append(b.lookup([Item("reserved", unit, torch.int32)]))
                observed.append(a.insert(["reserved"], [tensor(3)], publish=True))
                wait_until(lambda: cache.stats().publishes_ok == 1, "the publish")
                assert b.wait(WAIT_S)
                observed.append([None if v is None else raw(v) for v in b.embeddings()])
            observed.append([None if v is None else raw(v) for v in a.embeddings()])
            observed.append(a.fallback_reasons())
            observed.append(cache.remove("stored"))
        observed.append(cache.entry_state("broken") is QUARANTINED)
        observed.append(cache.fence())
        for n in range(6):  # fills the pool: evicts in LRU order
            with cache.request(f"fill-{n}") as request:
                observed.append(request.insert([f"fill-{n}"], [tensor(10 + n)], publish=False))
        observed.append([cache.entry_state(f"fill-{n}") is READY for n in range(6)])
        observed.append(cache.clear())
        cache.check_invariants()
        stats = dataclasses.replace(cache.stats(), oldest_pin_age_s=0.0)
    return {"observed": observed, "stats": stats, "trace": trace, "calls": store.calls}


def test_checking_on_does_not_change_behaviour() -> None:
    was = lock_checking_enabled()
    try:
        enable_lock_checking(True)
        checked = scripted_flow()
        enable_lock_checking(False)
        unchecked_run = scripted_flow()
    finally:
        enable_lock_checking(was)
    assert checked == unchecked_run
    actions = {event["action"] for event in checked["trace"]}
    assert {"BeginLoad", "EndLoad", "Publish", "EndPublish", "Evict", "Remove", "Fence"} <= actions
    assert checked["observed"][-2] == [False, False, True, True, True, True]  # LRU eviction
    assert checked["stats"].evictions == 3 and checked["stats"].loads_unknown == 1
