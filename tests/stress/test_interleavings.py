"""Thread interleavings at the cache's unlocked gaps, explored by a deterministic scheduler.

Every change of shared state happens under the cache lock, so the schedules that matter are
the orders of whole lock sections and of what runs between them: completion callbacks
(``end_loads`` and its wake-ups), request bookkeeping, ``wait``/``wait_async`` against the
wake-up, insert against remove, close against a load in flight, publish against remove,
fence against an UNKNOWN load, two overlapping fences against a re-quarantine,
the pipeline's lookup/encode/insert, the poison of a freed range (debug mode) against the next
allocation of that range, wake-ups against the cache's close, and trace events against a fence
(each thread delivers its events with no lock held). ``GapScheduler`` runs
the threads of a scenario one at a time and switches only at those gaps: before each
acquisition and after each release of the cache lock, before each store call, in the encoder,
and in every wait (a wait with a timeout may be timed out there). A wait that can never end
is reported as a deadlock, with the schedule.

``explore`` is systematic: the default schedule (the running thread goes on while it can),
then every schedule that deviates from it once, then every one that deviates twice
(delay-bounded search; a deviation is a preemption, a timeout, or another pick than the first
when a thread blocks or ends). Each level runs in a seeded random order, so the per-scenario
limit (``EMBCACHE_INTERLEAVING_LIMIT``, default 150) cuts the last level to a uniform sample.
With a large limit every schedule within two deviations runs: about 12,000 for all scenarios
but the fence one (under a minute), which alone has more than 40,000. The two scenarios with
at most 150 such schedules run completely in CI.

Why not ``frontrun`` (which installs and runs on Python 3.11): its opcode-level exploration
did not find the stale wake-up bug fixed in 3dfca44 (``_signal`` set ``done`` after releasing
the lock; the driver now wakes under the lock of its step runner, ``StepRunner.run``), neither
DPOR in 1,700 executions nor its random strategy in 200, because the window spans whole method
calls.
``explore`` finds it in a few dozen schedules (the self-test below keeps that true), and a
poison written after the lock is released (issue 42) in 25. Each self-test plants its bug by
wrapping the real funnel (``tests.support.funnel.replace_funnel``), never by a copy of it.
Nothing to install.

Which build runs does not matter: the explorer replaces only driver attributes (the lock, the
funnel ``StepRunner.run`` in the self-tests), and the driver is Python in both builds (the
compiled core is ``embcache/core``); the tests run unchanged on either.

The cache is given ``ManualIO`` as its I/O executor, whose jobs run on a scheduled ``io``
thread, and scheduled events as its request Events (``io_executor``, ``new_event``); its lock
is wrapped in a ``ScheduledLock`` (the hierarchy checker still runs), the one private
attribute this file sets: the gaps it explores are the lock's acquisitions and releases. The one
it reads is the requests' Events (``_wakeups``), which the stale wake-up plant sets itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item, Reason, Status, TransferOutcome
from embcache.core.effects import Effects
from embcache.core.entries import RequestState
from embcache.core.lifecycle import ABSENT, QUARANTINED, READY
from embcache.driver.locks import CACHE_LEVEL, HierarchyLock, assert_unlocked
from embcache.driver.request import Request
from embcache.errors import ClosedError
from embcache.testing import Fault, FaultInjectingStore
from tests.support.compiled import core_is_compiled
from tests.support.funnel import Funnel, replace_funnel
from tests.support.helpers import raw

pytestmark = [pytest.mark.stress, pytest.mark.timeout(120)]

DEVIATIONS = 2  # per schedule: a preemption, a timeout, or a non-default pick
LIMIT = int(os.environ.get("EMBCACHE_INTERLEAVING_LIMIT", "150"))  # schedules per scenario
MAX_SWITCHES = 5000
UNIT = (64,)  # one float32 item: 256 bytes, one alignment unit


class Aborted(BaseException):
    """Unwinds the scenario's threads after a schedule failed."""


# ---------------------------------------------------------------------------- the scheduler
class GapScheduler:
    """Runs named threads one at a time, switching only at ``point``/``wait_until``."""

    def __init__(self, choose: Callable[[int, int], int]) -> None:
        self.choose = choose  # (decision depth, number of options) -> option index
        self.taken: list[int] = []
        self.options: list[list[tuple[str, bool, int]]] = []  # (thread, time it out?, cost)
        self._cv = threading.Condition()
        self._turn: str | None = None
        self._status: dict[str, str] = {}  # ready | blocked | timed | done
        self._wakeable: dict[str, Callable[[], bool]] = {}
        self._timed_out: set[str] = set()
        self._local = threading.local()
        self.trace: list[str] = []
        self.errors: list[str] = []
        self.failure: str | None = None

    # -- API for code under test
    def managed(self) -> str | None:
        """The scenario thread running this code, or None for any other thread."""
        name: str | None = getattr(self._local, "name", None)
        if name is not None and self.failure is not None:
            raise Aborted
        return name

    def point(self, label: str) -> None:
        """A switch: the scheduler may run any other thread before this one goes on."""
        name = self.managed()
        if name is None:
            return
        with self._cv:
            self._switch(name, label)

    def wait_until(self, ready: Callable[[], bool], label: str, *, timed: bool) -> bool:
        """Block this thread until ``ready()``; a ``timed`` wait may time out (returns False)."""
        name = self.managed()
        if name is None:
            raise RuntimeError("wait_until outside a scheduled thread")
        with self._cv:
            self._status[name] = "timed" if timed else "blocked"
            self._wakeable[name] = ready
            self._switch(name, label)
            self._status[name] = "ready"
            del self._wakeable[name]
            if name in self._timed_out:
                self._timed_out.discard(name)
                return False
            return True

    # -- running a schedule
    def run(self, workers: dict[str, Callable[[], None]], timeout: float = 20.0) -> None:
        threads = [
            threading.Thread(target=self._body, args=(name, body), name=f"sched-{name}")
            for name, body in workers.items()
        ]
        with self._cv:
            self._status = dict.fromkeys(workers, "ready")
        for thread in threads:
            thread.start()
        with self._cv:
            self._pick()
            finished = self._cv.wait_for(
                lambda: self.failure is not None or all(s == "done" for s in self._status.values()),
                timeout,
            )
            if not finished:
                self._fail(f"schedule did not finish within {timeout} s")
        for thread in threads:
            thread.join(timeout)
        if any(t.is_alive() for t in threads):
            self._fail("threads still alive after the schedule failed")

    def report(self) -> str:
        tail = "\n  ".join(self.trace[-60:])
        errors = "\n".join(self.errors)
        return (
            f"schedule {self.taken}: {self.failure or 'worker error'}\n{errors}\n"
            f"last switches (thread: where):\n  {tail}"
        )

    # -- internals (under self._cv)
    def _body(self, name: str, body: Callable[[], None]) -> None:
        self._local.name = name
        with self._cv:
            self._await_turn(name)
        try:
            body()
        except Aborted:
            pass
        except BaseException:
            self.errors.append(f"[{name}] {traceback.format_exc()}")
        finally:
            with self._cv:
                self._status[name] = "done"
                self.trace.append(f"{name}: done")
                if self._turn == name:
                    self._pick()
                self._cv.notify_all()

    def _switch(self, name: str, label: str) -> None:
        self.trace.append(f"{name}: {label}")
        if len(self.trace) > MAX_SWITCHES:
            self._fail(f"more than {MAX_SWITCHES} switches: livelock?")
            raise Aborted
        self._pick(name)
        self._await_turn(name)

    def _await_turn(self, name: str) -> None:
        self._cv.wait_for(lambda: self._turn == name or self.failure is not None)
        if self.failure is not None:
            raise Aborted

    def _pick(self, current: str | None = None) -> None:
        """Give the turn to the next thread: the prefix's choice at this depth, else option 0
        (the current thread goes on if it can). Options cost 1 when they preempt a thread
        that could go on, or time out a wait."""

        def can_run(n: str) -> bool:
            s = self._status[n]
            return s == "ready" or (s in ("blocked", "timed") and self._wakeable[n]())

        live = sorted(n for n in self._status if can_run(n))
        options: list[tuple[str, bool, int]] = []
        if current is not None and current in live:
            options.append((current, False, 0))
            options += [(n, False, 1) for n in live if n != current]
        else:  # the current thread blocked or ended: the first other one is the default
            options += [(n, False, int(i > 0)) for i, n in enumerate(live)]
        options += [
            (n, True, 1) for n, s in sorted(self._status.items()) if s == "timed" and n not in live
        ]
        if not options:
            stuck = {n: s for n, s in self._status.items() if s != "done"}
            if stuck:
                self._fail(f"deadlock: no thread can run, {stuck}")
            else:
                self._turn = None
                self._cv.notify_all()
            return
        depth = len(self.taken)
        index = self.choose(depth, len(options))
        if index >= len(options):
            self._fail(f"nondeterministic replay at decision {depth}: {options}")
            return
        self.options.append(options)
        self.taken.append(index)
        chosen, time_out, _ = options[index]
        if time_out:
            self._timed_out.add(chosen)
        self._turn = chosen
        self._cv.notify_all()

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        self._turn = None
        self._cv.notify_all()


# ---------------------------------------------------------------------------- scheduled stand-ins
class ScheduledLock:
    """The cache lock, with a switch before each acquisition and after each release (never
    while it is held, so a paused thread never holds it)."""

    def __init__(self, sched: GapScheduler) -> None:
        self._inner = HierarchyLock(CACHE_LEVEL, "cache lock")
        self._sched = sched
        self.level = self._inner.level
        self.name = self._inner.name

    def acquire(self) -> None:
        self._sched.point(f"lock in {sys._getframe(2).f_code.co_name}")
        self._inner.acquire()

    def release(self) -> None:
        self._inner.release()
        self._sched.point(f"unlock in {sys._getframe(2).f_code.co_name}")

    def locked(self) -> bool:
        return bool(self._inner.locked())

    def __enter__(self) -> ScheduledLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ScheduledEvent:
    """A request's ``done`` event: ``wait`` blocks in the scheduler, and may time out there."""

    def __init__(self, sched: GapScheduler, is_set: bool) -> None:
        self._sched = sched
        self._flag = is_set

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag or timeout == 0:
            self._sched.point("wait (no block)")
            return self._flag
        return self._sched.wait_until(lambda: self._flag, "wait", timed=timeout is not None)


class ManualIO:
    """Stands in for the cache's I/O pool: jobs run on the scheduled ``io`` thread."""

    def __init__(self, sched: GapScheduler) -> None:
        self._sched = sched
        self.jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.others_done: Callable[[], bool] = lambda: True

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.jobs.append((fn, args))

    def worker(self) -> None:
        """The ``io`` thread: run jobs as they come, until every other thread is done."""
        while self._sched.wait_until(
            lambda: bool(self.jobs) or self.others_done(), "io idle", timed=False
        ):
            if not self.jobs:
                return
            fn, args = self.jobs.pop(0)
            fn(*args)

    def drain(self) -> None:
        while self.jobs:
            fn, args = self.jobs.pop(0)
            fn(*args)

    def shutdown(self, wait: bool = True) -> None:
        self.drain()


class ScheduledStore(FaultInjectingStore):
    """An ``FaultInjectingStore`` with a switch before every call, whose UNKNOWN transfers really
    are still in flight: they land at the next ``fence`` (the latest moment the protocol
    allows). A read lands garbage in its range; a write stores the range's bytes as they are
    then. So a quarantined range reused before the fence is caught by the byte checks. A
    fence stops (lands) only the transfers in limbo when it began; ``hold[thread]`` makes that
    thread's store fence wait, after it began, until the predicate holds (a slow fence)."""

    def __init__(self, sched: GapScheduler) -> None:
        super().__init__(delay_seconds=0.0)
        self.sched = sched
        self.pool_tensor: torch.Tensor | None = None
        self.limbo: list[tuple[str, str, int, int]] = []  # (call, key, offset, size)
        self.hold: dict[str, Callable[[], bool]] = {}

    def register_buffer(self, buffer: torch.Tensor) -> None:
        super().register_buffer(buffer)
        self.pool_tensor = buffer

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.sched.point("store exists")
        return super().exists(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self.sched.point("store get_into")
        return self._remember("get_into", keys, offsets, sizes, super().get_into)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self.sched.point("store put_from")
        return self._remember("put_from", keys, offsets, sizes, super().put_from)

    def fence(self) -> None:
        self.sched.point("store fence")
        assert self.pool_tensor is not None
        covered, self.limbo = self.limbo, []  # in flight when this fence began
        hold = self.hold.get(self.sched.managed() or "")
        if hold is not None:
            self.sched.wait_until(hold, "store fence held", timed=False)
        for call, key, offset, size in covered:
            if call == "get_into":
                self.pool_tensor[offset : offset + size] = 0xFF
            else:
                self.put_object(key, self.pool_tensor[offset : offset + size].numpy().tobytes())
        super().fence()

    def _remember(
        self,
        call: str,
        keys: Sequence[str],
        offsets: Sequence[int],
        sizes: Sequence[int],
        transfer: Callable[[Sequence[str], Sequence[int], Sequence[int]], list[int]],
    ) -> list[int]:
        codes = transfer(keys, offsets, sizes)
        for key, offset, size, code in zip(keys, offsets, sizes, codes, strict=True):
            if code < 0 and self.classify(code) is TransferOutcome.UNKNOWN:
                self.limbo.append((call, key, offset, size))
        return codes


# ---------------------------------------------------------------------------- a world per schedule
def payload(key: str) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32) + sum(key.encode()) * 1000


def item(key: str) -> Item:
    return Item(key, UNIT, torch.float32)


@dataclass
class World:
    """A cache whose lock, I/O pool, store and request events are scheduled."""

    sched: GapScheduler
    cache: EmbeddingCache
    store: ScheduledStore
    io: ManualIO
    requests: dict[str, Request] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    sink: ScheduledSink | None = None

    def request(self, request_id: str) -> Request:
        request = self.cache.request(request_id)
        self.requests[request_id] = request
        return request

    def read(self, request: Request, key: str) -> None:
        """Whatever ``request`` is served for ``key`` is ``key``'s payload."""
        for it, view in zip(request.items, request.embeddings(), strict=True):
            if it.key == key and view is not None:
                assert torch.equal(view, payload(key)), f"{key}: served wrong bytes"
                self.notes.setdefault(f"served:{request.request_id}", True)

    def run(self, **workers: Callable[[], None]) -> None:
        names = list(workers)
        self.io.others_done = lambda: all(
            self.sched._status.get(n) == "done" for n in names if n != "io"
        )
        self.sched.run({**workers, "io": self.io.worker})

    def settle(self) -> None:
        """After the schedule: close every request, finish leftover I/O, check, fence."""
        self.cache.check_invariants()
        for request in self.requests.values():
            request.close()
        self.io.drain()
        self.cache.check_invariants()
        self.cache.fence()
        stats = self.cache.stats()
        assert stats.open_requests == 0 and stats.pinned_entries == 0, stats
        assert set(stats.entries_by_state) <= {"READY"}, stats
        assert stats.allocated_bytes == sum(stats.bytes_by_state.values()), stats
        for key in list(self.cache.snapshot().entries):
            with self.cache.request(f"final-{key}") as request:
                request.lookup([item(key)], prefetch=False)
                view = request.embeddings()[0]
                assert view is not None, f"{key}: not served at the end"
                assert torch.equal(view, payload(key)), f"{key}: wrong bytes at the end"
        self.cache.clear()
        assert self.cache.stats().allocated_bytes == 0, "bytes leaked"
        self.cache.check_invariants()
        self.check_trace()

    def settle_closed(self) -> None:
        """After a schedule that closed the cache: every request closes (``close`` still
        works), leftover I/O ends, nothing stays pinned or waited on, no future is left."""
        self.cache.check_invariants()
        for request in self.requests.values():
            request.close()
        self.io.drain()
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.open_requests == 0 and stats.pinned_entries == 0, stats
        sizes = self.cache.sizes()
        assert sizes["async_waiters"] == 0, sizes
        self.check_trace()

    def check_trace(self) -> None:
        """When traced: every event reached the sink once, in ``seq`` order; each fence's
        ``Fence`` follows its ``BeginFence`` and frees only keys of its snapshot, each
        QUARANTINED by its last event before the ``Fence``."""
        if self.sink is None:
            return
        events = self.sink.events
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "trace out of order"
        snapshots: dict[int, set[str]] = {}
        last_state: dict[str, str] = {}
        for e in events:
            if e["action"] == "BeginFence":
                snapshots[e["fence"]] = set(e["keys"])
            elif e["action"] == "Fence":
                assert e["fence"] in snapshots, f"Fence {e['fence']} before its BeginFence"
                for key in e["keys"]:
                    assert key in snapshots[e["fence"]], f"fence {e['fence']} freed {key}"
                    assert last_state.get(key) == "QUARANTINED", (key, last_state.get(key))
                    last_state[key] = "ABSENT"
            elif e.get("key") is not None and "state" in e:
                last_state[e["key"]] = e["state"]


class ScheduledSink:
    """A trace sink with a switch before every event it takes: the delivery of one thread's
    events may interleave with any other thread's lock sections and deliveries."""

    def __init__(self, sched: GapScheduler) -> None:
        self.sched = sched
        self.events: list[dict[str, Any]] = []

    def append(self, event: dict[str, Any], /) -> None:
        self.sched.point(f"trace {event['action']}")
        self.events.append(event)


@contextlib.contextmanager
def world(
    choose: Callable[[int, int], int],
    capacity_units: int = 8,
    *,
    poison: bool = False,
    traced: bool = False,
) -> Iterator[World]:
    """A fresh scheduled world. No background fencer (``auto_fence=None``): a fence runs only
    where a scenario calls it, from a scheduled thread, so every schedule replays exactly."""
    sched = GapScheduler(choose)
    store = ScheduledStore(sched)
    io = ManualIO(sched)
    sink = ScheduledSink(sched) if traced else None
    cache = EmbeddingCache(
        capacity_units * 256,
        store=store,
        pin_memory=False,
        io_executor=io,
        new_event=lambda: ScheduledEvent(sched, False),  # type: ignore[arg-type,return-value]
        auto_fence=None,
        poison_freed=poison,
        trace=sink,
    )
    # The explorer switches threads at every acquisition and release of the cache lock (the
    # gaps it explores): the runner's lock, replaced before any request runs.
    cache.runner.lock = ScheduledLock(sched)  # type: ignore[assignment]
    try:
        yield World(sched, cache, store, io, sink=sink)
    finally:
        cache.close()


Chooser = Callable[[int, int], int]


def checked(scenario: Callable[[World], None], **options: Any) -> Callable[[Chooser], World]:
    """Run ``scenario`` in a fresh world (``options``: ``world``'s) under one schedule, then
    settle and check it (``settle_closed`` when the scenario closed the cache)."""

    def run(choose: Chooser) -> World:
        with world(choose, **options) as w:
            try:
                scenario(w)
                if w.sched.failure is None and not w.sched.errors:
                    if w.notes.get("cache closed"):
                        w.settle_closed()
                    else:
                        w.settle()
            except AssertionError as exc:
                w.sched.errors.append(f"[check] {exc!r}")
        return w

    return run


def follow(prefix: Sequence[int]) -> Chooser:
    """Take ``prefix``'s choices, then the default (option 0) at every later decision."""
    return lambda depth, _: prefix[depth] if depth < len(prefix) else 0


@dataclass
class Exploration:
    schedules: int
    exhausted: bool
    first_failure: World | None

    def check(self, name: str) -> None:
        assert self.first_failure is None, f"{name}: " + self.first_failure.sched.report()


def explore(
    run: Callable[[Chooser], World], bound: int = DEVIATIONS, limit: int | None = None
) -> Exploration:
    """Run the default schedule, then every schedule with one deviation from it, then every
    one with two, ... up to ``bound``; each level in a seeded random order, so a ``limit``
    cuts the last level to a uniform sample. Stops at the first failing schedule.

    A deviation is any choice other than the default: a preemption (another thread runs
    although the current one could go on), a timeout of a wait, or another pick than the
    first when the current thread blocks or ends (delay bounding)."""
    rng = random.Random(0)
    level: list[list[int]] = [[]]
    schedules = 0
    for deviations in range(bound + 1):
        rng.shuffle(level)
        deeper: list[list[int]] = []
        for prefix in level:
            if limit is not None and schedules >= limit:
                return Exploration(schedules, False, None)
            w = run(follow(prefix))
            schedules += 1
            if w.sched.failure is not None or w.sched.errors:
                return Exploration(schedules, False, w)
            if deviations < bound:
                taken, options = w.sched.taken, w.sched.options
                deeper += [
                    [*taken[:depth], index]
                    for depth in range(len(prefix), len(taken))
                    for index in range(1, len(options[depth]))
                ]
        level = deeper
    return Exploration(schedules, True, None)


# ---------------------------------------------------------------------------- scenarios
def load_completion_vs_wait_and_close(w: World) -> None:
    """A store load completes (EndLoad, then the wake-up) while one waiter waits (and may
    time out), another closes mid-load, and the key is removed."""
    w.store.put_object("k", raw(payload("k")))
    a, b = w.request("a"), w.request("b")
    assert a.lookup([item("k")])[0].status is Status.LOADING
    assert b.lookup([item("k")])[0].status is Status.LOADING

    def waiter() -> None:
        ok = a.wait(5.0)
        w.read(a, "k")
        reason = a.fallback_reasons()[0]
        if ok:
            assert reason in (None, Reason.REMOVED), reason
        a.close()

    w.run(waiter=waiter, closer=b.close, remover=lambda: w.cache.remove("k"))


def single_flight_insert_vs_wait_vs_remove(w: World) -> None:
    """A reservation is filled while a joined request waits and the key is removed."""
    a, b = w.request("a"), w.request("b")
    assert a.lookup([item("k")], reserve_misses=True)[0].status is Status.RESERVED
    assert b.lookup([item("k")], reserve_misses=True)[0].status is Status.LOADING

    def filler() -> None:
        result = a.insert(["k"], [payload("k")], publish=False)
        assert a.lookup([item("k")])[0].status in (Status.HIT, Status.MISS)
        w.read(a, "k")
        w.notes["inserted"] = result == [True]
        a.close()

    def waiter() -> None:
        if b.wait(5.0):
            reason = b.fallback_reasons()[0]
            assert reason in (None, Reason.REMOVED), reason
        w.read(b, "k")
        b.close()

    w.run(filler=filler, waiter=waiter, remover=lambda: w.cache.remove("k"))


def wake_up_vs_lookup_of_another_loading_key(w: World) -> None:
    """The stale wake-up of 3dfca44: b, woken for k1, looks up k2 (still loading): its next
    ``wait(0)`` must say it is still waiting."""
    a, b, c = w.request("a"), w.request("b"), w.request("c")
    a.lookup([item("k1")], reserve_misses=True)
    c.lookup([item("k2")], reserve_misses=True)
    assert b.lookup([item("k1")])[0].status is Status.LOADING

    def waiter() -> None:
        assert b.lookup([item("k2")])[0].status is Status.LOADING
        assert not b.wait(0.0), "wait returned True while k2 is still loading (stale wake-up)"

    w.run(filler=lambda: a.insert(["k1"], [payload("k1")], publish=False), waiter=waiter)


def insert_vs_remove_vs_reserving_lookup(w: World) -> None:
    """Two requests race to insert the same fresh key (one directly, one via a reservation)
    while it is removed twice."""

    def inserter() -> None:
        with w.cache.request("a") as a:
            a.insert(["k"], [payload("k")], publish=False)
            a.lookup([item("k")])
            w.read(a, "k")

    def reserver() -> None:
        with w.cache.request("b") as b:
            if b.lookup([item("k")], reserve_misses=True)[0].status is Status.RESERVED:
                b.insert(["k"], [payload("k")], publish=False)
            b.wait(5.0)
            w.read(b, "k")

    def remover() -> None:
        w.cache.remove("k")
        w.cache.remove("k")

    w.run(inserter=inserter, reserver=reserver, remover=remover)


def publish_vs_remove_vs_close(w: World, fault: Fault | None) -> None:
    """A publish (its own pin) ends OK, FAILED or UNKNOWN while its request closes, the key is
    removed and another request reads it."""
    w.store.inject("k", fault)
    a = w.request("a")
    assert a.insert(["k"], [payload("k")], publish=True) == [True]

    def reader() -> None:
        with w.cache.request("b") as b:
            b.lookup([item("k")], prefetch=False)
            w.read(b, "k")

    w.run(closer=a.close, remover=lambda: w.cache.remove("k"), reader=reader)
    stored = w.store.object("k")
    assert stored in (None, raw(payload("k"))), "a publish stored wrong bytes"
    assert (stored is not None) == (fault is None)


def fence_vs_unknown_load(w: World) -> None:
    """A load ends UNKNOWN (quarantine) while a fence runs and other requests allocate: a
    quarantined range is never reused before a fence that started after it."""
    w.store.put_object("k", raw(payload("k")))
    w.store.inject("k", Fault.UNKNOWN)
    a = w.request("a")
    assert a.lookup([item("k")])[0].status is Status.LOADING

    def filler() -> None:
        for n in range(8):  # fills the pool: only non-quarantined ranges may be used
            with w.cache.request(f"f{n}") as f:
                f.insert([f"x{n}"], [payload(f"x{n}")], publish=False)
                f.lookup([item(f"x{n}")])
                w.read(f, f"x{n}")

    def waiter() -> None:
        a.wait(5.0)
        assert a.embeddings()[0] is None
        a.close()

    w.run(fencer=w.cache.fence, filler=filler, waiter=waiter)
    assert w.cache.entry_state("k") in (ABSENT, QUARANTINED)


def overlapping_fences_vs_requarantine(w: World) -> None:
    """Issue 25: two fences in flight snapshot the QUARANTINED ``k``; the fast one frees it;
    ``k`` is loaded again and ends UNKNOWN (QUARANTINED again, by a read the slow fence, held
    in the store until then, does not cover); then the slow one ends and others fill the pool.
    The slow fence must not free the new entry: its stray read lands at the next fence, in
    whatever the range holds then (settle's byte checks read every entry)."""
    w.store.put_object("k", raw(payload("k")))
    w.store.inject("k", Fault.UNKNOWN)
    with w.cache.request("q") as q:
        q.lookup([item("k")])
        w.io.drain()
    assert w.cache.entry_state("k") is QUARANTINED
    w.store.hold["slow"] = lambda: bool(w.notes.get("reloaded"))
    fenced: list[int] = []

    def fence() -> None:
        fenced.append(w.cache.fence())

    def reloader() -> None:
        # k is freed: the slow fence cannot end before this thread is done, so the one that
        # ended first is the fast one, and it freed k
        w.sched.wait_until(lambda: bool(fenced), "a fence ended", timed=False)
        assert w.cache.entry_state("k") is ABSENT
        with w.cache.request("a") as a:
            a.lookup([item("k")])
            a.wait(5.0)
            w.read(a, "k")
        w.notes["reloaded"] = True

    def filler() -> None:
        w.sched.wait_until(lambda: len(fenced) == 2, "both fences ended", timed=False)
        for n in range(8):
            with w.cache.request(f"f{n}") as f:
                f.insert([f"x{n}"], [payload(f"x{n}")], publish=False)
                f.lookup([item(f"x{n}")])
                w.read(f, f"x{n}")

    w.run(slow=fence, fast=fence, reloader=reloader, filler=filler)
    assert sorted(fenced) in ([0, 1], [1, 1]), fenced  # k freed once per entry it was


def close_while_load_vs_clear(w: World) -> None:
    """A request closes while its load is in flight and the cache is cleared twice."""
    w.store.put_object("k", raw(payload("k")))
    w.store.put_object("j", raw(payload("j")))
    a = w.request("a")
    a.lookup([item("k"), item("j")])

    def clearer() -> None:
        w.cache.clear()
        w.cache.clear()

    def reader() -> None:
        with w.cache.request("b") as b:
            b.lookup([item("j")])
            b.wait(5.0)
            w.read(b, "j")

    w.run(closer=a.close, clearer=clearer, reader=reader)
    assert w.cache.entry_state("k") in (ABSENT, READY)


def async_wait_vs_wake_up(w: World, timeout: float) -> None:
    """``wait_async`` (long or zero timeout) against the insert that wakes it; a timed-out wait
    leaves no future behind."""
    a, b = w.request("a"), w.request("b")
    a.lookup([item("k")], reserve_misses=True)
    assert b.lookup([item("k")])[0].status is Status.LOADING

    def async_waiter() -> None:
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(b.wait_async(timeout))
            ready = loop._ready  # type: ignore[attr-defined]  # callbacks due: one step runs them

            def has_work() -> bool:
                return bool(ready)

            while not task.done():  # step the loop; block while it has nothing to run
                loop.run_until_complete(asyncio.sleep(0))
                if not task.done():
                    w.sched.wait_until(has_work, "event loop idle", timed=False)
            ok = task.result()
        finally:
            loop.close()
        assert w.cache.sizes()["async_waiters"] == 0, "a finished wait_async left its future"
        if timeout:
            assert ok, "a long wait_async was not woken"
        w.read(b, "k")
        b.close()

    w.run(filler=lambda: a.insert(["k"], [payload("k")], publish=False), waiter=async_waiter)


class ScheduledEncoder:
    """Encodes key ``n`` to ``payload(n)``, with a switch inside every call."""

    def __init__(self, sched: GapScheduler) -> None:
        self.device = torch.device("cpu")
        self.sched = sched
        self.encoded: list[str] = []

    def __call__(self, inputs: Sequence[str]) -> list[torch.Tensor]:
        assert_unlocked("test encoder")
        self.sched.point("encoder")
        self.encoded += inputs
        return [payload(key) for key in inputs]


def two_pipelines_share_keys(w: World) -> None:
    """Two ``EncodePipeline.encode`` calls on overlapping keys (single flight: one may wait
    for the other's encode, or time out and encode itself) while a key is removed."""
    encoder = ScheduledEncoder(w.sched)
    pipeline = EncodePipeline(w.cache, encoder, prefetch_timeout=5.0)
    results: dict[str, torch.Tensor] = {}

    def call(name: str, keys: list[str]) -> Callable[[], None]:
        def body() -> None:
            results[name] = pipeline.encode(name, [item(k) for k in keys], keys)
            assert torch.equal(results[name], torch.cat([payload(k) for k in keys]))

        return body

    w.run(
        p=call("p", ["k", "j"]),
        q=call("q", ["j", "k", "m"]),
        remover=lambda: w.cache.remove("j"),
    )
    assert set(results) == {"p", "q"}
    assert sorted(set(encoder.encoded)) == ["j", "k", "m"]


def poison_vs_next_allocation(w: World) -> None:
    """Poison (the debug mode, a pool of one range) against the next allocation of the range:
    ``k`` fills the pool; it is removed while a reader holds it (freed when the reader closes,
    or at once) and evicted by another request's insert of ``j`` into the same range. Each
    freed range is poisoned before anyone can take it, so whatever is served, and every
    entry at the end, holds its own bytes, never 0xFF."""
    with w.cache.request("seed") as seed:
        assert seed.insert(["k"], [payload("k")], publish=False) == [True]

    def reader() -> None:
        with w.cache.request("b") as b:
            b.lookup([item("k")], prefetch=False)
            w.read(b, "k")

    def inserter() -> None:
        with w.cache.request("a") as a:
            if a.insert(["j"], [payload("j")], publish=False) == [True]:
                a.lookup([item("j")], prefetch=False)
                w.read(a, "j")

    # named so that the default schedule frees k first: one preemption after it exposes a
    # poison written after the lock is released (threads run in name order by default)
    w.run(freer=lambda: w.cache.remove("k"), inserter=inserter, reader=reader)


def wake_ups_vs_close(w: World) -> None:
    """A waiter waits, with no timeout, on a key another request reserved, while that request
    fills it (or finds the cache closed and closes, ending its reservation) and the cache
    closes: the waiter is always woken (a lost wake-up is a deadlock here), and afterwards
    every request closes with nothing left pinned, waited on or pending."""
    a, b = w.request("a"), w.request("b")
    assert a.lookup([item("k")], reserve_misses=True)[0].status is Status.RESERVED
    assert b.lookup([item("k")])[0].status is Status.LOADING

    def filler() -> None:
        with contextlib.suppress(ClosedError):
            a.insert(["k"], [payload("k")], publish=False)
        a.close()

    def waiter() -> None:
        try:
            woken = b.wait(None)
        except ClosedError:  # the cache closed before the wait began
            woken = True
        assert woken, "an untimed wait returned False"
        with contextlib.suppress(ClosedError):
            w.read(b, "k")
        b.close()

    def closer() -> None:
        w.cache.close()
        w.notes["cache closed"] = True

    w.run(filler=filler, waiter=waiter, closer=closer)


def events_vs_fence(w: World) -> None:
    """Trace events against a fence (a traced world): ``k`` is QUARANTINED (its load ended
    UNKNOWN); a fence runs while another request loads ``k`` again (UNKNOWN again: a
    re-quarantine the fence does not cover) and a third inserts and removes ``x``. Each thread
    hands its events to the sink with no lock held, so deliveries interleave with the fence's
    two steps; ``World.check_trace`` checks the order and what each ``Fence`` freed."""
    w.store.put_object("k", raw(payload("k")))
    w.store.inject("k", Fault.UNKNOWN)
    with w.cache.request("q") as q:
        q.lookup([item("k")])
        w.io.drain()
    assert w.cache.entry_state("k") is QUARANTINED

    def reloader() -> None:
        with w.cache.request("a") as a:
            a.lookup([item("k")])
            a.wait(5.0)
            w.read(a, "k")

    def churn() -> None:
        with w.cache.request("c") as c:
            c.insert(["x"], [payload("x")], publish=False)
        w.cache.remove("x")

    w.run(fencer=w.cache.fence, reloader=reloader, churn=churn)


SCENARIOS: dict[str, Callable[[World], None]] = {
    "load completion vs wait and close": load_completion_vs_wait_and_close,
    "single flight: insert vs wait vs remove": single_flight_insert_vs_wait_vs_remove,
    "wake-up vs lookup of another loading key": wake_up_vs_lookup_of_another_loading_key,
    "insert vs remove vs reserving lookup": insert_vs_remove_vs_reserving_lookup,
    "publish OK vs remove vs close": functools.partial(publish_vs_remove_vs_close, fault=None),
    "publish FAILED vs remove vs close": functools.partial(
        publish_vs_remove_vs_close, fault=Fault.FAIL
    ),
    "publish UNKNOWN vs remove vs close": functools.partial(
        publish_vs_remove_vs_close, fault=Fault.UNKNOWN
    ),
    "fence vs UNKNOWN load": fence_vs_unknown_load,
    "overlapping fences vs re-quarantine": overlapping_fences_vs_requarantine,
    "close while load vs clear": close_while_load_vs_clear,
    "wait_async(60) vs wake-up": functools.partial(async_wait_vs_wake_up, timeout=60.0),
    "wait_async(0) vs wake-up": functools.partial(async_wait_vs_wake_up, timeout=0.0),
    "two pipelines share keys": two_pipelines_share_keys,
    "poison vs next allocation of the range": poison_vs_next_allocation,
    "wake-ups vs close": wake_ups_vs_close,
    "trace events vs a fence": events_vs_fence,
}
OPTIONS: dict[str, dict[str, Any]] = {  # ``world``'s options, where a scenario needs some
    "poison vs next allocation of the range": {"capacity_units": 1, "poison": True},
    "trace events vs a fence": {"traced": True},
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_explored_schedule_keeps_the_invariants(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = explore(checked(SCENARIOS[name], **OPTIONS.get(name, {})), limit=LIMIT)
    result.check(name)
    assert result.schedules > 10, f"{name}: only {result.schedules} schedules"
    with capsys.disabled():
        done = "all" if result.exhausted else "sampled"
        print(f"\n{name}: {result.schedules} schedules ({done}, <= {DEVIATIONS} deviations)")


# ---------------------------------------------------------------------------- self-test
# Each plant wraps the real funnel (``replace_funnel``) and moves one of its effects out of the
# step's lock section: the plant repeats no part of the funnel, and differs from it only there.
def moved(step: Callable[..., Effects[Any]], effect: str, into: list[Any]) -> Callable[..., Any]:
    """``step``, with its ``effect`` (``wake`` or ``freed``) taken out into ``into``, so the
    funnel that runs it does nothing about it."""

    def run(*args: Any, **kwargs: Any) -> Effects[Any]:
        fx = step(*args, **kwargs)
        into.extend(getattr(fx, effect))
        setattr(fx, effect, ())
        return fx

    return run


def ready_event(cache: EmbeddingCache, rs: RequestState) -> Effects[Any]:
    """A step: ``rs``'s Event if it waited and nothing of it is pending now, else None."""
    wakeup = cache.runner.wakeups.get(rs)  # (read under the lock: this is a step)
    return Effects(None if wakeup is None or rs.pending() else wakeup.event)


def stale_wake_up(cache: EmbeddingCache) -> Callable[[Funnel], Funnel]:
    """The wake-up of ``_signal`` before 3dfca44: a step's woken requests are not woken in its
    lock section; after it, each one's Event is looked up in a lock section of its own (set
    only if nothing is pending then) and set with no lock held, when the request may be
    waiting on another load again."""

    def make(funnel: Funnel) -> Funnel:
        def planted(step: Callable[..., Effects[Any]], *args: Any, **kwargs: Any) -> Any:
            woken: list[RequestState] = []
            result = funnel(moved(step, "wake", woken), *args, **kwargs)
            for rs in woken:
                event = funnel(ready_event, cache, rs)
                if event is not None:
                    event.set()
            return result

        return planted

    return make


def freed(ranges: list[tuple[int, int]]) -> Effects[None]:
    """A step that changes nothing and frees ``ranges`` (the funnel poisons them)."""
    fx: Effects[None] = Effects(None)
    fx.freed = ranges
    return fx


def late_poison(funnel: Funnel) -> Funnel:
    """The bug of issue 42: a step's freed ranges are poisoned after its lock section (in one
    of their own), so another thread may allocate and fill a range before its poison lands."""

    def planted(step: Callable[..., Effects[Any]], *args: Any, **kwargs: Any) -> Any:
        ranges: list[tuple[int, int]] = []
        result = funnel(moved(step, "freed", ranges), *args, **kwargs)
        if ranges:
            funnel(freed, ranges)
        return result

    return planted


def test_the_scheduler_finds_the_stale_wake_up_bug_of_3dfca44() -> None:
    def mutant(w: World) -> None:
        replace_funnel(w.cache, stale_wake_up(w.cache))
        wake_up_vs_lookup_of_another_loading_key(w)

    result = explore(checked(mutant))
    assert result.first_failure is not None, (
        f"the stale wake-up mutant survived {result.schedules} schedules"
    )
    report = result.first_failure.sched.report()
    assert "stale wake-up" in report, report
    print(f"stale wake-up found after {result.schedules} schedules:\n{report}")


def test_the_explorer_finds_a_late_poison_deterministically() -> None:
    """The planted late poison fails the poison scenario, at the same schedule every time,
    within the scenario's limit (the default schedule passes: the bug needs a preemption)."""

    def mutant(w: World) -> None:
        replace_funnel(w.cache, late_poison)
        poison_vs_next_allocation(w)

    options = OPTIONS["poison vs next allocation of the range"]
    runs = [explore(checked(mutant, **options), limit=LIMIT) for _ in range(2)]
    first, again = (run.first_failure for run in runs)
    assert first is not None, f"the late poison survived {runs[0].schedules} schedules"
    assert again is not None and again.sched.taken == first.sched.taken, "not deterministic"
    assert runs[0].schedules == runs[1].schedules > 1
    report = first.sched.report()
    assert "wrong bytes" in report, report
    build = "compiled" if core_is_compiled() else "pure"
    print(f"late poison found after {runs[0].schedules} schedules ({build} core):\n{report}")
