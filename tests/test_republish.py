"""Publishes that come back after an outage (``embcache.driver.backlog``), in-process store.

The real-master form (a killed and restarted ``mooncake_master``, a second worker getting the
global hits) is ``tests/mooncake_store/test_mooncake_republish.py``; these tests pin down the
backlog's rules with faults injected per key: FAILED publishes wait and are written once the
store answers; the oldest beyond the bound are dropped and counted; an entry evicted, removed or
quarantined since is never written; bad settings raise a specific error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from embcache import EmbeddingCache
from embcache.core.entries import Entry
from embcache.core.lifecycle import ABSENT, QUARANTINED
from embcache.core.outcomes import TransferOutcome
from embcache.driver.backlog import PublishBacklog, RepublishPolicy
from embcache.driver.item import Item
from embcache.driver.trace import TraceLog
from embcache.errors import ClosedError, InvalidArgumentError, InvalidTypeError
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import ManualExecutor, payload, raw, wait_until

pytestmark = pytest.mark.timeout(60)

ROW = (4, 64)  # float32: 1 KiB an item
SLOW = RepublishPolicy(retry_interval_s=60.0)  # no interval probe: only an OK publish retries


def outage(store: FaultInjectingStore, keys: list[str], down: bool) -> None:
    for key in keys:
        store.inject(key, Fault.FAIL if down else None)


def insert(cache: EmbeddingCache, keys: list[str], seed: int = 0) -> list[torch.Tensor]:
    tensors = [payload(ROW, torch.float32, seed + i) for i in range(len(keys))]
    with cache.request(f"insert-{keys[0]}") as request:
        assert request.insert(keys, tensors) == [True] * len(keys)
    return tensors


def settled(cache: EmbeddingCache, started: int) -> Callable[[], bool]:
    """Every publish started so far has ended."""

    def done() -> bool:
        s = cache.stats()
        return s.publishes_started >= started and s.publishes_started == (
            s.publishes_ok + s.publishes_failed + s.publishes_unknown
        )

    return done


def test_failed_publishes_are_written_when_the_store_answers_by_the_interval_probe() -> None:
    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(5)]
    outage(store, keys, down=True)
    policy = RepublishPolicy(retry_interval_s=0.02)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=policy) as cache:
        tensors = insert(cache, keys)
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        assert cache.stats().publish_backlog == len(keys)
        time.sleep(0.1)  # probes while the store is down: one entry each, back to the backlog
        stats = cache.stats()
        assert stats.publish_backlog == len(keys)
        assert stats.hits == 0, "a retry's pin is no request's hit"
        assert all(store.object(k) is None for k in keys)
        outage(store, keys, down=False)
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to drain")
        wait_until(settled(cache, 0), "the publishes to end")
        for key, tensor in zip(keys, tensors, strict=True):
            assert store.object(key) == raw(tensor)
        stats = cache.stats()
        assert (stats.publish_backlog_dropped, stats.publish_backlog_stale, stats.hits) == (0, 0, 0)
        assert stats.pinned_entries == stats.open_requests == 0
        cache.check_invariants()


def test_an_ok_publish_retries_the_whole_backlog_at_once() -> None:
    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(4)]
    outage(store, keys, down=True)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=SLOW) as cache:
        tensors = insert(cache, keys)
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        outage(store, keys, down=False)
        time.sleep(0.05)
        assert cache.stats().publish_backlog == len(keys), "no probe within the interval"
        insert(cache, ["fresh"], seed=100)  # the store answers this one: the backlog follows
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to drain")
        wait_until(settled(cache, 0), "the publishes to end")
        assert [store.object(k) for k in keys] == [raw(t) for t in tensors]
        cache.check_invariants()


def test_an_ok_publish_says_the_store_answered_only_while_publishes_wait() -> None:
    """``note``'s answer is what wakes the republisher (``EmbeddingCache._run_publishes``): an
    OK publish with nothing waiting has nothing to retry and must wake no thread (before, every
    OK publish woke it, a context switch a publish for nothing); one with failed publishes
    waiting wakes it, the same note's failures included."""

    ok, failed = TransferOutcome.OK, TransferOutcome.FAILED
    e = {k: Entry(k, (1,), "u8", 0, 1) for k in "abcde"}
    backlog = PublishBacklog(8)
    assert not backlog.note([e["a"], e["b"]], [ok, ok])  # nothing waits: nobody to wake
    assert not backlog.note([e["c"]], [failed])  # no OK: the store has not answered
    assert backlog.note([e["d"]], [ok])  # c waits: retry it now
    assert backlog.take() == [e["c"]]
    assert not backlog.note([e["c"]], [ok])  # the retry ended OK and nothing else waits
    assert backlog.note([e["d"], e["e"]], [ok, failed])  # e waits, and the store answered
    assert len(backlog) == 1


def test_entries_evicted_removed_or_quarantined_since_are_never_published(
    trace: TraceLog | None = None,
) -> None:
    store = FaultInjectingStore()
    evicted, removed, quarantined, kept = keys = ["evicted", "removed", "quarantined", "kept"]
    outage(store, keys, down=True)
    capacity = 6 * 1024  # six items: two more evict the two oldest idle ones
    with EmbeddingCache(  # lru: the inserts below evict the oldest idle entries
        capacity, store=store, pin_memory=False, republish=SLOW, auto_fence=None, trace=trace,
        policy="lru",
    ) as cache:
        for i, key in enumerate(keys):
            insert(cache, [key], seed=i)
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        assert cache.remove(removed)
        store.inject(quarantined, Fault.UNKNOWN)  # a second publish of it ends UNKNOWN
        with cache.request("quarantine") as request:
            request.lookup([Item(quarantined, ROW, torch.float32)])
            assert request.publish([quarantined]) == [True]
            wait_until(lambda: cache.stats().publishes_unknown == 1, "the UNKNOWN publish")
        assert cache.entry_state(quarantined) is QUARANTINED
        with cache.request("touch") as request:  # ``kept`` is newer: ``evicted`` is the oldest
            request.lookup([Item(kept, ROW, torch.float32)])
        outage(store, keys, down=False)
        store.inject(quarantined, None)
        insert(cache, ["x1", "x2", "x3", "x4"], seed=10)  # evicts ``evicted``; OK: retries
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to empty")
        wait_until(settled(cache, 0), "the publishes to end")
        assert store.object(kept) is not None
        assert [store.object(k) for k in (evicted, removed, quarantined)] == [None] * 3
        stats = cache.stats()
        assert stats.publish_backlog_stale == 3
        assert stats.publish_backlog_dropped == 0
        cache.check_invariants()


def test_the_backlog_is_bounded_oldest_dropped_first_and_counted() -> None:
    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(7)]
    outage(store, keys, down=True)
    policy = RepublishPolicy(max_entries=3, retry_interval_s=60.0)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=policy) as cache:
        tensors = [t for i, key in enumerate(keys) for t in insert(cache, [key], seed=i)]
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        stats = cache.stats()
        assert (stats.publish_backlog, stats.publish_backlog_dropped) == (3, 4)
        outage(store, keys, down=False)
        insert(cache, ["fresh"], seed=100)
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to drain")
        wait_until(settled(cache, 0), "the publishes to end")
        assert [store.object(k) for k in keys[:4]] == [None] * 4, "the oldest were dropped"
        assert [store.object(k) for k in keys[4:]] == [raw(t) for t in tensors[4:]]
        assert cache.stats().publish_backlog_dropped == 4
        cache.check_invariants()


def test_a_retry_that_fails_again_keeps_its_place_and_the_bound() -> None:
    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(3)]
    outage(store, keys, down=True)
    policy = RepublishPolicy(max_entries=3, retry_interval_s=0.01)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=policy) as cache:
        for i, key in enumerate(keys):
            insert(cache, [key], seed=i)
        wait_until(lambda: cache.stats().publishes_failed >= 20, "several failed probes")
        stats = cache.stats()
        assert (stats.publish_backlog, stats.publish_backlog_dropped) == (3, 0)
        store.inject("late", Fault.FAIL)
        insert(cache, ["late"], seed=9)  # the fourth failure drops the oldest: k0
        wait_until(lambda: cache.stats().publish_backlog_dropped == 1, "the drop")
        outage(store, [*keys, "late"], down=False)
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to drain")
        wait_until(settled(cache, 0), "the publishes to end")
        assert store.object("k0") is None
        assert all(store.object(k) is not None for k in ("k1", "k2", "late"))
        cache.check_invariants()


# ------------------------------------------------------------------ each edge, step by step
# No retry thread (``background=False``) and an I/O pool that runs a write only when the test
# says: a retry is ``retry_publishes`` and stays in flight until its task runs.


def stepped(
    store: FaultInjectingStore, max_entries: int, capacity: int = 64 << 10, background: bool = False
) -> tuple[EmbeddingCache, ManualExecutor]:
    io = ManualExecutor()
    policy = RepublishPolicy(max_entries=max_entries, retry_interval_s=60.0, background=background)
    cache = EmbeddingCache(  # lru: an insert into a full pool evicts the oldest idle entry
        capacity, store=store, pin_memory=False, io_executor=io, republish=policy,
        auto_fence=None, policy="lru",
    )  # fmt: skip
    return cache, io


def backlog_counts(cache: EmbeddingCache) -> tuple[int, int, int, int]:
    """(waiting or in flight, dropped, stale, retries in flight the bound dropped)."""
    s = cache.stats()
    marks = cache.sizes()["backlog_marks"]
    return (s.publish_backlog, s.publish_backlog_dropped, s.publish_backlog_stale, marks)


def publish_again(cache: EmbeddingCache, key: str) -> None:
    with cache.request(f"again-{key}") as request:
        request.lookup([Item(key, ROW, torch.float32)])
        assert request.publish([key]) == [True]


def test_a_retry_dropped_in_flight_is_forgotten_and_its_key_may_fail_and_wait_again() -> None:
    """Planted bug caught: the mark of a retry that the bound dropped while in flight is kept
    when that retry ends (``note`` without ``self._forgotten.discard(key)``): the key's next
    FAILED publish is then ignored (never retried, never written) and the marks grow by one
    each time (``sizes()["backlog_marks"]``)."""
    store = FaultInjectingStore()
    keys = ["k0", "k1", "k2"]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=2)
    with cache:
        tensors = [t for i, key in enumerate(keys) for t in insert(cache, [key], seed=i)]
        io.run(0)  # k0's publish fails: it waits
        assert cache.retry_publishes(1) == 1  # k0's retry: in flight (the last task)
        io.run(0)
        io.run(0)  # k1 and k2 fail: one too many, the oldest (k0, in flight) is dropped
        assert backlog_counts(cache) == (2, 1, 0, 1)
        io.run(0)  # k0's retry ends FAILED: it was dropped, it does not come back
        assert backlog_counts(cache) == (2, 1, 0, 0)
        publish_again(cache, "k0")  # k0 fails again: it waits, newest; k1 is dropped
        io.run_all()
        assert backlog_counts(cache) == (2, 2, 0, 0)
        outage(store, keys, down=False)
        assert cache.retry_publishes() == 2
        io.run_all()
        assert [store.object(k) for k in keys] == [raw(tensors[0]), None, raw(tensors[2])]
        assert backlog_counts(cache) == (0, 2, 0, 0)
        cache.check_invariants()


def test_a_retry_that_ends_unknown_is_quarantined_and_never_retried() -> None:
    """DESIGN: an UNKNOWN publish quarantines its entry and is never retried, a retry's too.
    Planted bug caught: ``note`` putting a retried entry back for any outcome but OK (``else``
    for ``elif outcome is TransferOutcome.FAILED``): the UNKNOWN retry waits again, then counts
    as stale when the next retry finds it quarantined."""
    store = FaultInjectingStore()
    cache, io = stepped(store, max_entries=4)
    with cache:
        store.inject("k0", Fault.FAIL)
        insert(cache, ["k0"])
        io.run_all()
        assert backlog_counts(cache) == (1, 0, 0, 0)
        store.inject("k0", Fault.UNKNOWN)  # the store comes back half-way: the retry may land
        assert cache.retry_publishes() == 1
        io.run_all()
        assert cache.stats().publishes_unknown == 1
        assert cache.entry_state("k0") is QUARANTINED
        assert backlog_counts(cache) == (0, 0, 0, 0), "an UNKNOWN retry never waits again"
        store.inject("k0", None)
        puts = store.calls["put_from"]
        assert cache.retry_publishes() == 0
        io.run_all()
        assert store.calls["put_from"] == puts
        assert backlog_counts(cache) == (0, 0, 0, 0)
        cache.check_invariants()


def test_retries_failing_together_go_back_oldest_first_so_the_bound_drops_the_oldest() -> None:
    """Several retries in one write, all FAILED: they go back to the oldest end in their age
    order, so one more failure drops the oldest of them. Planted bug caught: putting them back
    in reverse age order (``for entry in back`` for ``reversed(back)``): the bound then drops
    the newest (k2 is lost, k0 written)."""
    store = FaultInjectingStore()
    keys = ["k0", "k1", "k2", "late"]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=3)
    with cache:
        tensors = [t for i, key in enumerate(keys[:3]) for t in insert(cache, [key], seed=i)]
        io.run_all()
        assert cache.retry_publishes() == 3  # one write of three keys
        assert len(io.tasks) == 1
        io.run_all()
        assert backlog_counts(cache) == (3, 0, 0, 0)
        tensors += insert(cache, ["late"], seed=3)
        io.run_all()  # a fourth failure: the oldest, k0, is dropped
        assert backlog_counts(cache) == (3, 1, 0, 0)
        outage(store, keys, down=False)
        assert cache.retry_publishes() == 3
        io.run_all()
        assert store.object("k0") is None
        assert [store.object(k) for k in keys[1:]] == [raw(t) for t in tensors[1:]]
        assert backlog_counts(cache) == (0, 1, 0, 0)
        cache.check_invariants()


def test_entries_evicted_or_quarantined_while_waiting_are_stale_and_never_written() -> None:
    """Planted bugs caught: ``skipped`` not counting what it drops (``stale`` stays 0); a
    retry that no longer checks its entry is still READY, undoomed and untainted
    (``publishing.republish`` without that check: the retry step raises on the
    quarantined entry)."""
    store = FaultInjectingStore()
    keys = ["evicted", "quarantined", "kept"]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=8, capacity=4 * 1024)  # four items
    with cache:
        tensors = [t for i, key in enumerate(keys) for t in insert(cache, [key], seed=i)]
        io.run_all()
        assert backlog_counts(cache) == (3, 0, 0, 0)
        store.inject("quarantined", Fault.UNKNOWN)
        publish_again(cache, "quarantined")
        io.run_all()
        assert cache.entry_state("quarantined") is QUARANTINED
        with cache.request("touch") as request:  # ``kept`` is newer: ``evicted`` is the oldest
            request.lookup([Item("kept", ROW, torch.float32)])
        outage(store, [*keys, "x1", "x2"], down=False)
        insert(cache, ["x1", "x2"], seed=10)  # the fifth item evicts ``evicted``
        assert cache.entry_state("evicted") is ABSENT
        io.run_all()
        assert cache.retry_publishes() == 1  # ``kept`` alone
        io.run_all()
        assert store.object("kept") == raw(tensors[2])
        assert store.object("evicted") is None
        assert store.object("quarantined") is None
        assert backlog_counts(cache) == (0, 0, 2, 0)
        cache.check_invariants()


def test_a_key_published_by_a_request_while_it_waits_leaves_the_backlog() -> None:
    """The store holds it: no retry writes it again. Planted bug caught: ``note`` leaving an
    OK publish's key in the backlog (without ``waiting.pop(key, None)``): the next retry
    writes it a second time."""
    store = FaultInjectingStore()
    cache, io = stepped(store, max_entries=4)
    with cache:
        store.inject("k0", Fault.FAIL)
        (tensor,) = insert(cache, ["k0"])
        io.run_all()
        store.inject("k0", None)
        publish_again(cache, "k0")
        io.run_all()
        assert store.object("k0") == raw(tensor)
        assert backlog_counts(cache) == (0, 0, 0, 0)
        puts = store.calls["put_from"]
        assert cache.retry_publishes() == 0
        assert store.calls["put_from"] == puts
        cache.check_invariants()


def test_retries_in_flight_when_the_store_answers_are_retried_at_once_if_they_fail() -> None:
    """An OK publish while the backlog's retries are all in flight finds nothing waiting to
    retry; each retry then ends as its own outcome says (OK: published, out of the backlog;
    FAILED: back), and failed ones are retried at once (they were sent before the store
    answered), not at the next interval (60 s here). Planted bug caught: ``note`` forgetting
    the answer seen while retries were in flight (returning ``ok and bool(waiting)`` only):
    k0 and k1 then wait for the probe and the test times out waiting for their retry."""
    store = FaultInjectingStore()
    outage(store, ["k0", "k1"], down=True)
    cache, io = stepped(store, max_entries=4, background=True)
    with cache:
        tensors = insert(cache, ["k0", "k1"])
        io.run_all()
        assert backlog_counts(cache) == (2, 0, 0, 0)
        insert(cache, ["fresh"], seed=5)  # the store answers this one: the backlog is retried
        io.run(0)
        wait_until(lambda: len(io.tasks) == 1, "the retry of all that waits")
        insert(cache, ["fresh2"], seed=6)
        io.run(1)  # another OK publish, the retry of k0 and k1 still in flight
        assert backlog_counts(cache) == (2, 0, 0, 0)
        io.run(0)  # the retry fails: its write was sent before the store answered
        assert store.object("k0") is None
        wait_until(lambda: len(io.tasks) == 1, "their retry, at once")
        outage(store, ["k0", "k1"], down=False)
        io.run_all()
        assert [store.object(k) for k in ("k0", "k1")] == [raw(t) for t in tensors]
        assert backlog_counts(cache) == (0, 0, 0, 0)
        cache.check_invariants()


def test_one_retry_at_a_time_so_a_failed_probe_is_dropped_before_a_newer_entry() -> None:
    """While a retry is in flight no other starts (``retry_publishes`` starts nothing): the
    entries that fail go back older than all that waits, and the bound drops the oldest.
    Planted bug caught: ``take`` handing out more while a retry is in flight; the probe of
    k0 then ends FAILED while k1's retry is still out, and one more failure drops k1 (in
    flight, dropped first) instead of the older k0."""
    store = FaultInjectingStore()
    keys = ["k0", "k1", "k2"]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=2)
    with cache:
        tensors = [t for i, key in enumerate(keys[:2]) for t in insert(cache, [key], seed=i)]
        io.run_all()
        assert cache.retry_publishes(1) == 1  # the probe: k0
        second = cache.retry_publishes(1)  # while k0's retry is in flight
        io.run(0)  # k0 fails again: back to the oldest end
        tensors += insert(cache, ["k2"], seed=2)
        io.run(len(io.tasks) - 1)  # one too many: k0, the oldest, is dropped
        io.run_all()
        outage(store, keys, down=False)
        cache.retry_publishes()
        io.run_all()
        assert [store.object(k) for k in keys] == [None, raw(tensors[1]), raw(tensors[2])]
        assert second == 0, "one retry at a time"
        assert backlog_counts(cache) == (0, 1, 0, 0)
        cache.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_entries": 0}, InvalidArgumentError),
        ({"max_entries": -1}, InvalidArgumentError),
        ({"max_entries": 2.5}, InvalidTypeError),
        ({"max_entries": True}, InvalidTypeError),
        ({"retry_interval_s": 0}, InvalidArgumentError),
        ({"retry_interval_s": -1.0}, InvalidArgumentError),
        ({"retry_interval_s": float("inf")}, InvalidArgumentError),
        ({"retry_interval_s": float("nan")}, InvalidArgumentError),
        ({"retry_interval_s": 1e10}, InvalidArgumentError),  # past threading.TIMEOUT_MAX
        ({"retry_interval_s": "1"}, InvalidTypeError),
    ],
)
def test_bad_backlog_settings_raise_a_specific_error(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        RepublishPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_longest_retry_interval_keeps_the_retry_thread_alive() -> None:
    """``threading.TIMEOUT_MAX`` is the longest wait a thread can make: the retry thread of a
    policy at that bound lives (one past it is refused above; before, the thread died at its
    first wait with OverflowError and no failed publish was ever retried)."""
    policy = RepublishPolicy(retry_interval_s=threading.TIMEOUT_MAX)
    before = set(threading.enumerate())  # (other tests' dropped caches may still have theirs)
    with EmbeddingCache(64 << 10, store=FaultInjectingStore(), pin_memory=False, republish=policy):
        (thread,) = [
            t for t in threading.enumerate() if t not in before and t.name == "embcache-republish"
        ]
        time.sleep(0.2)
        assert thread.is_alive(), "its first wait did not kill it"
    assert not thread.is_alive(), "close() ended it"


@pytest.mark.parametrize(
    ("limit", "error"),
    [(-1, InvalidArgumentError), (1.5, InvalidTypeError), (True, InvalidTypeError),
     ("1", InvalidTypeError)],
)  # fmt: skip
def test_a_bad_retry_limit_raises_a_specific_error_and_takes_nothing(
    limit: object, error: type[Exception]
) -> None:
    store = FaultInjectingStore()
    outage(store, ["a"], down=True)
    manual = RepublishPolicy(background=False)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=manual) as cache:
        insert(cache, ["a"])
        wait_until(settled(cache, 1), "the failed publish")
        with pytest.raises(error, match="limit"):
            cache.retry_publishes(limit)  # type: ignore[arg-type]
        assert cache.stats().publish_backlog == 1
        assert cache.retry_publishes(0) == 0  # none asked: nothing taken
        outage(store, ["a"], down=False)
        assert cache.retry_publishes(1) == 1  # still waiting: the retry writes it
        wait_until(lambda: cache.stats().publish_backlog == 0, "the retry")


def test_retrying_after_close_raises_with_or_without_a_backlog(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A closed cache retries nothing: ClosedError whether or not publishes wait (an empty
    backlog used to answer 0 as if open), and the close says how many were never written."""
    store = FaultInjectingStore()
    outage(store, ["a"], down=True)
    manual = RepublishPolicy(background=False)
    cache = EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=manual)
    insert(cache, ["a"])
    wait_until(settled(cache, 1), "the failed publish")
    with caplog.at_level("WARNING", logger="embcache.driver.cache"):
        cache.close()
    assert "closed with 1 failed publishes never written" in caplog.text
    assert cache.stats().publish_backlog == 1
    for closed in (
        cache,
        EmbeddingCache(64 << 10, store=FaultInjectingStore(), pin_memory=False),
        EmbeddingCache(64 << 10, pin_memory=False),  # no store: no backlog
    ):
        closed.close()
        with pytest.raises(ClosedError):
            closed.retry_publishes()
    assert cache.stats().publish_backlog == 1, "nothing taken"


def test_a_cache_refuses_a_republish_that_is_not_a_policy() -> None:
    store = FaultInjectingStore()
    with pytest.raises(InvalidTypeError, match="republish"):
        EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=4096)  # type: ignore[arg-type]
    assert store.pool is None, "nothing was registered"


def test_the_backlog_counters_reach_the_metrics() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from embcache.tools.metrics import CacheMetrics

    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(3)]
    outage(store, keys, down=True)
    policy = RepublishPolicy(max_entries=2, retry_interval_s=60.0)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=policy) as cache:
        insert(cache, keys)
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        metrics = CacheMetrics()
        metrics.add("a", cache)
        registry = CollectorRegistry()
        registry.register(metrics)
        text = generate_latest(registry).decode()
    assert 'embcache_publish_backlog{cache="a"} 2.0' in text
    assert 'embcache_publish_backlog_dropped_total{cache="a"} 1.0' in text
    assert 'embcache_publish_backlog_stale_total{cache="a"} 0.0' in text


@pytest.mark.tla
@pytest.mark.timeout(300)
def test_a_run_with_republishes_is_a_behaviour_of_the_spec_as_it_stands() -> None:
    # The retries are the actions of any request's publish: TLC accepts the trace of the run
    # above (failed publishes, a remove, a quarantine, an eviction, then the retries) with no
    # change to the spec.
    from tests.tla.tla_modules import load_trace

    log = TraceLog()
    test_entries_evicted_removed_or_quarantined_since_are_never_published(log)
    events = list(log.events)
    retries = {e["request"] for e in events if str(e.get("request", "")).startswith("republish#")}
    assert retries, "the run retried through the republish request"
    assert {e["action"] for e in events if e.get("request") in retries} >= {
        "OpenRequest", "Lookup", "Publish", "Release", "CloseRequest", "EndPublish"
    }  # fmt: skip
    [verdict] = load_trace().validate(traces=[("republish", events)], workers=1)
    assert verdict.accepted, verdict.describe()


# ------------------------------------------------------------------ every front end


def test_the_pipelines_failed_publishes_come_back() -> None:
    from embcache.pipeline import EncodePipeline
    from tests.test_pipeline import FakeEncoder, encode, expected, item

    store = FaultInjectingStore()
    keys = [item(n).key for n in range(4)]
    outage(store, keys, down=True)
    policy = RepublishPolicy(retry_interval_s=0.02)
    with EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=policy) as cache:
        encode(EncodePipeline(cache, FakeEncoder()), "during", list(range(4)))
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        outage(store, keys, down=False)
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to drain")
        wait_until(settled(cache, 0), "the publishes to end")
        assert [store.object(k) for k in keys] == [raw(expected(n)) for n in range(4)]


def test_the_sglang_adapters_failed_publishes_come_back() -> None:
    from embcache.integrations.sglang import EmbeddingCacheController
    from tests.support.sglang_mmencoder import DIM, DTYPE, Modality, embedding

    store = FaultInjectingStore()
    keys = ["sg-a", "sg-b", "sg-c"]
    outage(store, keys, down=True)
    ctl = EmbeddingCacheController(
        store, max_pool_size_gb=(64 << 10) / (1 << 30), hidden_dims={Modality.IMAGE: DIM},
        dtype=DTYPE,
    )  # fmt: skip
    try:
        tensors = [embedding(k, 4) for k in keys]
        ctl.wait_store_to_pool(ctl.store_to_pool_async(keys, tensors, Modality.IMAGE))
        ctl.insert_batch(keys, Modality.IMAGE)
        cache = ctl.cache
        wait_until(lambda: cache.stats().publishes_failed >= len(keys), "the failed publishes")
        assert cache.stats().publish_backlog == len(keys)
        outage(store, keys, down=False)  # the adapter's cache probes every second by default
        wait_until(lambda: cache.stats().publish_backlog == 0, "the backlog to drain")
        wait_until(settled(cache, 0), "the publishes to end")
        assert [store.object(k) for k in keys] == [raw(t) for t in tensors]
    finally:
        ctl.close()


def test_a_full_backlog_drops_the_oldest_even_while_it_is_being_retried() -> None:
    failed = TransferOutcome.FAILED
    e = {k: Entry(k, (1,), "u8", 0, 1) for k in "abcd"}
    backlog = PublishBacklog(2)
    backlog.note([e["a"], e["b"]], [failed, failed])
    assert backlog.take(1) == [e["a"]]  # the probe retries the oldest
    backlog.note([e["c"]], [failed])  # a third failure: the oldest (a, in flight) goes
    assert (len(backlog), backlog.dropped) == (2, 1)
    backlog.note([e["a"]], [failed])  # the dropped retry ends: it does not come back
    assert (len(backlog), backlog.dropped) == (2, 1)
    assert backlog.take() == [e["b"], e["c"]]
    backlog.note([e["d"]], [failed])  # b, the oldest, dropped while in flight
    backlog.skipped([e["b"], e["c"]], [False, False])  # c is gone from the cache: stale
    assert (len(backlog), backlog.dropped, backlog.stale) == (1, 2, 1)
    assert backlog.take() == [e["d"]]


_OUTCOMES = {o.name: o for o in TransferOutcome}


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.one_of(
            st.tuples(
                st.just("note"),
                st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from(list(_OUTCOMES)))),
            ),
            st.tuples(st.just("take"), st.sampled_from([None, 0, 1, 2])),
            st.tuples(st.just("skip"), st.lists(st.sampled_from("abcdef"))),
        ),
        max_size=40,
    ),
)
@example(  # a dropped retry still in flight: before, the next take started a second retry
    1, [("note", [("a", "FAILED")]), ("take", None), ("note", [("b", "FAILED")]),
        ("take", None), ("note", [("c", "FAILED")])],
)  # fmt: skip
def test_the_backlog_follows_its_model_however_outcomes_arrive(
    max_entries: int, ops: list[tuple[str, object]]
) -> None:
    """``PublishBacklog`` against ``models.backlog.ModelBacklog`` on any sequence of ended
    publishes, takes and skipped retries: a retry's outcomes in several pieces, mixed with
    other keys' (the cache ends a retry in one piece; a backlog must not rely on it). The
    order taken, the size and the counters agree. (The first form put each piece of failed
    retries at the oldest end and dropped retries in flight before older waiting entries; and
    it took a new retry while a dropped one was still in flight, so ``marks`` passed
    ``max_entries``.)"""
    from models.backlog import ModelBacklog

    model, backlog = ModelBacklog(max_entries), PublishBacklog(max_entries)
    entries = {k: Entry(k, (1,), "u8", 0, 1) for k in "abcdef"}
    for op, arg in ops:
        if op == "note":
            pairs = arg if isinstance(arg, list) else []
            model.note([k for k, _ in pairs], [o for _, o in pairs])
            backlog.note([entries[k] for k, _ in pairs], [_OUTCOMES[o] for _, o in pairs])
        elif op == "take":
            limit = arg if isinstance(arg, int) else None
            assert [e.key for e in backlog.take(limit)] == model.take(limit)
        else:
            keys = list(dict.fromkeys(arg if isinstance(arg, list) else []))
            for key in keys:
                model.skipped(key)
            backlog.skipped([entries[k] for k in keys], [False] * len(keys))
        assert (len(backlog), backlog.dropped, backlog.stale) == (
            len(model), model.dropped, model.stale,
        )  # fmt: skip
        assert backlog.marks == len(model.gone) <= max_entries
        assert len(model) <= max_entries
        backlog.check_invariants()  # the runtime check, on every state the model reaches
