"""The publish backlog's edges (``embcache.driver.backlog``), in-process store, step by step.

Each test drives one edge a user hits: settings at and past their bounds, a ``republish``
with no store, a backlog at its bound (exactly full, one more, a bound of 1), the same key
failing twice, a key re-inserted under a waiting failure, a close with a retry in flight, and
the counters (stats, metrics, ``check_invariants``) agreeing with the backlog at every step.
The rules themselves are ``tests/test_republish.py``'s; the real-master form of the
re-inserted key is ``tests/mooncake_store/test_mooncake_republish.py``.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import pytest
import torch

from embcache import EmbeddingCache
from embcache.core.entries import Entry
from embcache.core.outcomes import TransferOutcome
from embcache.driver.backlog import PublishBacklog, RepublishPolicy
from embcache.errors import ClosedError, InvalidArgumentError, InvalidTypeError, InvariantError
from embcache.testing import FaultInjectingStore
from tests.support.helpers import payload, raw, wait_until
from tests.test_republish import backlog_counts, insert, outage, publish_again, stepped

pytestmark = pytest.mark.timeout(60)

ROW = (4, 64)  # float32: 1 KiB an item, as tests/test_republish.py's


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"retry_interval_s": True}, InvalidTypeError),
        ({"retry_interval_s": False}, InvalidTypeError),
        ({"retry_interval_s": float("-inf")}, InvalidArgumentError),
        ({"retry_interval_s": -0.0}, InvalidArgumentError),
        ({"retry_interval_s": None}, InvalidTypeError),
        ({"max_entries": False}, InvalidTypeError),
        ({"max_entries": 1.0}, InvalidTypeError),
        ({"max_entries": "8"}, InvalidTypeError),
        ({"max_entries": None}, InvalidTypeError),
        ({"max_entries": -(10**30)}, InvalidArgumentError),
        ({"background": 1}, InvalidTypeError),
        ({"background": None}, InvalidTypeError),
    ],
)
def test_more_bad_backlog_settings_raise_a_specific_error(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        RepublishPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_largest_settings_are_accepted_and_a_huge_bound_costs_nothing_up_front() -> None:
    """A bound is a bound, not a size: ``max_entries`` of 10**30 allocates nothing, and the
    smallest positive interval is accepted (its thread just probes often)."""
    RepublishPolicy(max_entries=10**30, retry_interval_s=threading.TIMEOUT_MAX)
    RepublishPolicy(max_entries=1, retry_interval_s=5e-324)
    store = FaultInjectingStore()
    outage(store, ["a"], down=True)
    cache, io = stepped(store, max_entries=10**30)
    with cache:
        insert(cache, ["a"])
        io.run_all()
        assert backlog_counts(cache) == (1, 0, 0, 0)
        cache.check_invariants()


@pytest.mark.parametrize("policy", [RepublishPolicy(), RepublishPolicy(8, 0.5, background=False)])
def test_a_republish_policy_without_a_store_is_refused(policy: RepublishPolicy) -> None:
    """Without a store nothing is published, so nothing can fail and wait: a policy given
    with ``store=None`` is a mistake (before, silently ignored). The default policy is not
    "given": a cache built with neither is fine, and so is ``republish=None``."""
    with pytest.raises(InvalidArgumentError, match="republish"):
        EmbeddingCache(64 << 10, pin_memory=False, republish=policy)
    for cache in (
        EmbeddingCache(64 << 10, pin_memory=False),
        EmbeddingCache(64 << 10, pin_memory=False, republish=None),
    ):
        with cache:
            assert cache.retry_publishes() == 0
            assert backlog_counts(cache) == (0, 0, 0, 0)


# ------------------------------------------------------------------ a backlog at its bound


@pytest.mark.parametrize("bound", [1, 3])
def test_a_full_backlog_keeps_all_and_one_more_drops_exactly_the_oldest(bound: int) -> None:
    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(bound + 1)]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=bound)
    with cache:
        tensors = [t for i, key in enumerate(keys) for t in insert(cache, [key], seed=i)]
        for n in range(bound):
            io.run(0)
            assert backlog_counts(cache) == (n + 1, 0, 0, 0), "below and at the bound: kept"
        io.run(0)  # one more: the oldest (k0) is dropped, counted once
        assert backlog_counts(cache) == (bound, 1, 0, 0)
        cache.check_invariants()
        outage(store, keys, down=False)
        assert cache.retry_publishes() == bound
        io.run_all()
        assert store.object("k0") is None
        assert [store.object(k) for k in keys[1:]] == [raw(t) for t in tensors[1:]]
        assert backlog_counts(cache) == (0, 1, 0, 0)
        cache.check_invariants()


def test_a_bound_of_one_drops_its_probe_in_flight_for_a_newer_failure() -> None:
    """``max_entries=1``: the probe's entry is the whole backlog; a new failure while it is in
    flight drops it (forgotten when it ends), and no second retry starts until it ended."""
    store = FaultInjectingStore()
    outage(store, ["k0", "k1"], down=True)
    cache, io = stepped(store, max_entries=1)
    with cache:
        insert(cache, ["k0"])
        io.run_all()
        assert cache.retry_publishes() == 1  # k0's retry in flight
        t1 = insert(cache, ["k1"], seed=1)
        io.run(1)  # k1 fails: k0, in flight, is dropped
        assert backlog_counts(cache) == (1, 1, 0, 1)
        assert cache.retry_publishes() == 0, "the dropped retry is still in flight"
        io.run(0)  # k0's retry ends FAILED: forgotten
        assert backlog_counts(cache) == (1, 1, 0, 0)
        cache.check_invariants()
        outage(store, ["k0", "k1"], down=False)
        assert cache.retry_publishes() == 1
        io.run_all()
        assert (store.object("k0"), store.object("k1")) == (None, raw(t1[0]))
        assert backlog_counts(cache) == (0, 1, 0, 0)


def test_the_same_key_failing_twice_takes_one_slot_as_its_newest_failure() -> None:
    """A key whose publish fails again (a request published it again) waits once: one slot,
    aged as its latest failure, so the bound then drops an older key rather than it."""
    store = FaultInjectingStore()
    keys = ["k0", "k1", "k2"]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=2)
    with cache:
        tensors = [t for i, key in enumerate(keys) for t in insert(cache, [key], seed=i)]
        io.run(0)
        io.run(0)  # k0, k1 wait
        publish_again(cache, "k0")
        io.run(1)  # k0 fails again: still one slot, now the newest
        assert backlog_counts(cache) == (2, 0, 0, 0)
        io.run(0)  # k2 fails: k1, now the oldest, is dropped
        assert backlog_counts(cache) == (2, 1, 0, 0)
        outage(store, keys, down=False)
        assert cache.retry_publishes() == 2
        io.run_all()
        assert [store.object(k) for k in keys] == [raw(tensors[0]), None, raw(tensors[2])]
        assert cache.stats().publishes_started == 6  # 3 + k0 again + the 2 retries
        cache.check_invariants()


# ------------------------------------------------------------------ the entry behind a key


@pytest.mark.parametrize("how", ["removed", "evicted"])
def test_a_key_inserted_anew_under_a_waiting_failure_is_not_published_by_its_retry(
    how: str,
) -> None:
    """The backlog holds the very entry that failed: once it is gone (removed, evicted) its
    retry is stale, even if the key was inserted anew since, without a publish. Before, the
    retry published by key, so it wrote the new entry, which its insert asked not to publish,
    and counted nothing stale."""
    store = FaultInjectingStore()
    outage(store, ["k"], down=True)
    cache, io = stepped(store, max_entries=4, capacity=2 * 1024)  # two items
    with cache:
        insert(cache, ["k"])
        io.run_all()
        assert backlog_counts(cache) == (1, 0, 0, 0)
        if how == "removed":
            assert cache.remove("k")
        else:
            insert(cache, ["x1", "x2"], seed=5)  # lru: evicts k (x1 and x2 publish OK)
            io.run_all()
        fresh = payload(ROW, torch.float32, 9)
        assert cache.insert(["k"], [fresh], publish=False) == [True]
        store.inject("k", None)  # the store is back
        assert cache.retry_publishes() == 0, "the entry that failed is gone"
        io.run_all()
        assert store.object("k") is None, "an insert with publish=False was published"
        assert backlog_counts(cache)[:3] == (0, 0, 1)
        cache.check_invariants()


def test_a_probe_passes_over_stale_entries_to_the_oldest_live_one() -> None:
    """The oldest failures are the likeliest evicted (lru evicts the oldest idle entries): a
    probe (``retry_publishes(1)``, the retry thread's every interval) that finds its entry
    stale goes on to the next one at once, until a write starts. Before, a stale probe wrote
    nothing and the store went unprobed for one interval per stale entry at the head (4096
    at the default bound: over an hour at one a second)."""
    store = FaultInjectingStore()
    keys = [f"k{i}" for i in range(6)]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=8)
    with cache:
        tensors = [t for i, key in enumerate(keys) for t in insert(cache, [key], seed=i)]
        io.run_all()
        for key in keys[:4]:
            assert cache.remove(key)
        outage(store, keys, down=False)
        assert cache.retry_publishes(1) == 1, "the probe reached k4"
        assert backlog_counts(cache) == (2, 0, 4, 0)
        assert cache.retry_publishes(1) == 0, "one retry at a time: k4's is in flight"
        io.run_all()
        assert store.object("k4") == raw(tensors[4])
        assert cache.retry_publishes(5) == 1  # k5, the last: nothing else waits
        io.run_all()
        assert [store.object(k) for k in keys] == [None] * 4 + [raw(t) for t in tensors[4:]]
        assert backlog_counts(cache) == (0, 0, 4, 0)
        assert cache.stats().hits == 0
        cache.check_invariants()


def test_a_probe_with_only_stale_entries_empties_the_backlog_and_writes_nothing() -> None:
    store = FaultInjectingStore()
    outage(store, ["k0", "k1"], down=True)
    cache, io = stepped(store, max_entries=8)
    with cache:
        insert(cache, ["k0", "k1"])
        io.run_all()
        cache.clear()
        puts = store.calls["put_from"]
        assert cache.retry_publishes(1) == 0
        assert backlog_counts(cache) == (0, 0, 2, 0)
        assert store.calls["put_from"] == puts and not io.tasks
        cache.check_invariants()


# ------------------------------------------------------------------ close


def republisher_thread(before: set[threading.Thread]) -> threading.Thread:
    """The retry thread started since ``before`` (other tests' dropped caches may still have
    theirs)."""
    (thread,) = [
        t for t in threading.enumerate() if t not in before and t.name == "embcache-republish"
    ]
    return thread


def test_close_with_a_retry_in_flight_ends_the_retry_thread_and_retries_nothing_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FaultInjectingStore()
    outage(store, ["k0", "k1"], down=True)
    before = set(threading.enumerate())
    cache, io = stepped(store, max_entries=4, background=True)
    thread = republisher_thread(before)
    insert(cache, ["k0", "k1"])
    io.run_all()
    insert(cache, ["fresh"], seed=3)
    io.run(0)  # an OK publish: the republisher retries both
    wait_until(lambda: len(io.tasks) == 1, "the retry of both")
    with caplog.at_level(logging.WARNING):
        cache.close()  # the retry still in flight ends FAILED in the I/O pool's shutdown
        cache.close()  # twice: nothing more
    assert not thread.is_alive()
    assert backlog_counts(cache) == (2, 0, 0, 0)
    puts = store.calls["put_from"]
    with pytest.raises(ClosedError):
        cache.retry_publishes()
    time.sleep(0.05)
    assert store.calls["put_from"] == puts, "no retry after close"
    assert [r.getMessage() for r in caplog.records] == [
        "closed with 2 failed publishes never written to the store"
    ]
    assert not io.tasks
    cache.check_invariants()


def test_closing_while_the_retry_thread_probes_leaves_no_thread_and_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A close racing the retry thread (probing every few microseconds, the store down): the
    retry either ran before the close or is refused by it (ClosedError, its entries back);
    no thread outlives the close, nothing is logged but the count never written, and the
    backlog still holds every failed publish."""
    for n in range(20):
        store = FaultInjectingStore()
        keys = [f"r{n}-{i}" for i in range(3)]
        outage(store, keys, down=True)
        policy = RepublishPolicy(retry_interval_s=1e-5)
        before = set(threading.enumerate())
        cache = EmbeddingCache(64 << 10, store=store, pin_memory=False, republish=policy)
        thread = republisher_thread(before)
        insert(cache, keys)
        wait_until(lambda c=cache: c.stats().publishes_failed >= 5, "several probes")
        with caplog.at_level(logging.WARNING):
            cache.close()
        assert not thread.is_alive()
        assert cache.stats().publish_backlog == 3
        assert cache.sizes()["backlog_marks"] == 0
        cache.check_invariants()
    messages = {r.getMessage() for r in caplog.records}
    assert messages == {"closed with 3 failed publishes never written to the store"}


# ------------------------------------------------------------------ counters and invariants


def test_stats_metrics_and_the_backlog_agree_at_every_step() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from embcache.tools.metrics import CacheMetrics

    store = FaultInjectingStore()
    keys = ["k0", "k1", "k2", "k3"]
    outage(store, keys, down=True)
    cache, io = stepped(store, max_entries=2, capacity=4 * 1024)
    metrics = CacheMetrics()
    metrics.add("c", cache)
    registry = CollectorRegistry()
    registry.register(metrics)

    def agree(expected: tuple[int, int, int, int]) -> None:
        assert backlog_counts(cache) == expected
        text = generate_latest(registry).decode()
        size, dropped, stale, _ = expected
        assert f'embcache_publish_backlog{{cache="c"}} {float(size)}' in text
        assert f'embcache_publish_backlog_dropped_total{{cache="c"}} {float(dropped)}' in text
        assert f'embcache_publish_backlog_stale_total{{cache="c"}} {float(stale)}' in text
        cache.check_invariants()

    with cache:
        agree((0, 0, 0, 0))
        insert(cache, keys[:3])
        io.run_all()  # one write of three: the oldest dropped
        agree((2, 1, 0, 0))
        assert cache.retry_publishes(1) == 1  # k1's probe
        agree((2, 1, 0, 0))
        insert(cache, ["k3"], seed=3)
        io.run(1)  # k3 fails: k1, in flight and the oldest, is dropped
        agree((2, 2, 0, 1))
        io.run(0)  # the probe ends: forgotten
        agree((2, 2, 0, 0))
        assert cache.remove("k2")
        outage(store, keys, down=False)
        assert cache.retry_publishes() == 1  # k2 removed: stale; k3 written
        agree((1, 2, 1, 0))
        io.run_all()
        agree((0, 2, 1, 0))


def test_check_invariants_covers_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backlog's invariants (``PublishBacklog.check_invariants``, run by the cache's):
    at most ``max_entries`` waiting or in flight, and as many dropped retries still in flight;
    each key once, under its own entry; the waiting ones in age order. Planted bug caught:
    failed retries put back after the newer failures rather than merged in by age (the
    backlog's ``heapq.merge`` replaced by a concatenation): the waiting ones are then out of
    age order, and the cache's ``check_invariants`` says so."""
    failed = TransferOutcome.FAILED
    e = {k: Entry(k, (1,), "u8", 0, 1) for k in "abc"}
    backlog = PublishBacklog(2)
    backlog.note([e["a"], e["b"]], [failed, failed])
    assert backlog.take(1) == [e["a"]]
    backlog.note([e["c"]], [failed])  # a, in flight and the oldest, dropped
    backlog.check_invariants()
    backlog.note([e["a"]], [failed])  # forgotten
    backlog.check_invariants()

    class Concatenated:
        @staticmethod
        def merge(*runs: Iterable[object], key: object = None) -> Iterator[object]:
            return itertools.chain(*reversed(runs))  # the newer failures first: wrong

    monkeypatch.setattr("embcache.driver.backlog.heapq", Concatenated)
    store = FaultInjectingStore()
    outage(store, ["k0", "k1"], down=True)
    cache, io = stepped(store, max_entries=4)
    with cache:
        insert(cache, ["k0"])
        io.run_all()
        assert cache.retry_publishes() == 1  # k0 in flight
        insert(cache, ["k1"], seed=1)
        io.run(1)  # k1 fails: waits
        cache.check_invariants()
        io.run(0)  # k0's retry fails: back after k1, out of age order
        with pytest.raises(InvariantError, match=r"backlog.*age order"):
            cache.check_invariants()


@pytest.mark.parametrize(
    ("bound", "error"),
    [(0, InvalidArgumentError), (-1, InvalidArgumentError), (True, InvalidTypeError),
     (2.5, InvalidTypeError), ("4", InvalidTypeError)],
)  # fmt: skip
def test_a_backlog_built_with_a_bad_bound_raises_a_specific_error(
    bound: object, error: type[Exception]
) -> None:
    """``PublishBacklog`` is public: its bound is checked as ``RepublishPolicy.max_entries``
    is. Before, -1 failed an assert at the first failed publish, 0 dropped every one, and
    True or 2.5 were taken as bounds."""
    with pytest.raises(error, match="max_entries"):
        PublishBacklog(bound)  # type: ignore[arg-type]


# ------------------------------------------------------------------ a cache dropped unclosed


def test_a_cache_dropped_without_close_ends_its_republish_thread_with_nothing_waiting() -> None:
    """The thread holds the cache weakly and asks for it at every wake, backlog empty or not
    (planted bug: asked only when something waits, so a cache dropped with an empty backlog
    left its thread polling forever; the thread also must not hold the cache across a wait)."""
    def republishers() -> int:
        return sum(t.name == "embcache-republish" for t in threading.enumerate())

    before = republishers()
    cache = EmbeddingCache(
        1 << 16, store=FaultInjectingStore(), auto_fence=None,
        republish=RepublishPolicy(retry_interval_s=0.01),
    )  # fmt: skip
    assert republishers() == before + 1
    time.sleep(0.05)  # a few empty wakes
    dropped = weakref.ref(cache)
    del cache
    gc.collect()
    assert dropped() is None
    wait_until(lambda: republishers() == before, "the republish thread to end", timeout_s=5)
