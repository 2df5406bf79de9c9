"""Publishes that come back after an outage: the bounded backlog of failed publishes.

Theory of operation. A publish that ends FAILED wrote nothing (the store refused it, or was
unreachable: Mooncake fails items at once with ``MASTER_UNREACHABLE`` while its master is down),
so its entry may be written again later. The cache's I/O threads hand every ended publish to
``PublishBacklog.note``: a FAILED one joins the backlog (its key and the very ``Entry`` object),
an OK one says the store answers. A background thread (``Republisher``) tries the backlog again:
all of it at once after any publish ended OK while it is not empty, and its oldest entry alone
every ``retry_interval_s`` (the probe: while the store is down it fails at once and goes back
to the oldest end; when it ends OK, the rest follows at once). With
``RepublishPolicy(background=False)`` there is no thread, and only
``EmbeddingCache.retry_publishes`` tries it again (a test drives each retry as a step).

"The store returned" is thus "a store write succeeded": no call beyond the ``GlobalStore``
protocol, no probe while nothing waits, one write an interval while the store stays down. A
retry is the cache's ``CacheCore.publish`` step with no request (the same actions as any
publish, under an internal request) for the very entry that failed, still its key's, READY,
neither doomed nor tainted; an entry evicted, removed or quarantined since is dropped unwritten
(``stale``), even if its key was cached anew (that entry was published by its own insert, or
was not to be). A retry that found every entry it took stale takes the next oldest at once, so
the probe writes the oldest live entry. One retry is in flight at a time (``take`` gives
nothing until it ended), so the backlog stays in age order: each waiting publish keeps the age
of its first failure, and failed retries go back older than all that failed since, so the
bound drops the oldest failure first. A publish ending UNKNOWN never joins (its entry is
quarantined), a retry's included; a key published OK by a request while it waits leaves the
backlog; an OK publish while retries are in flight makes those that come back FAILED retried
at once (embcache/DESIGN.md, "Publishes after an outage").

Bounded: at most ``max_entries`` wait; one more drops the oldest (``dropped``). The counters
are in ``EmbeddingCache.stats()`` (``publish_backlog``, ``publish_backlog_dropped``,
``publish_backlog_stale``, read together: ``counts``) and the Prometheus metrics; the
backlog's invariants (``check_invariants``) are part of ``EmbeddingCache.check_invariants``.
A backlog needs a store: ``EmbeddingCache`` refuses a ``republish`` policy given with
``store=None`` (InvalidArgumentError). Lock: ``_lock`` is a leaf (level
``BACKLOG_LEVEL``), held only to move keys in or out, never across a store call or a step.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from embcache.core.entries import Entry
from embcache.core.outcomes import TransferOutcome
from embcache.driver.locks import new_lock
from embcache.errors import ClosedError, InvalidArgumentError, InvalidTypeError, InvariantError

__all__ = ["BACKLOG_LEVEL", "PublishBacklog", "RepublishPolicy", "Republisher"]
log = logging.getLogger(__name__)

BACKLOG_LEVEL = 4  # above the trace outbox's (3): a leaf, taken with no other lock held


@dataclass(frozen=True)
class RepublishPolicy:
    """How many failed publishes wait for the store (``max_entries``, the oldest dropped
    beyond it) and how often they are tried again while it stays down (``retry_interval_s``,
    at most ``threading.TIMEOUT_MAX``: a longer wait would end the retry thread).
    ``background=False``: no retry thread; only ``EmbeddingCache.retry_publishes`` retries."""

    max_entries: int = 4096
    retry_interval_s: float = 1.0
    background: bool = True

    def __post_init__(self) -> None:
        _check_bound(self.max_entries)
        s = self.retry_interval_s
        if isinstance(s, bool) or not isinstance(s, int | float):
            raise InvalidTypeError(f"retry_interval_s must be a number, got {s!r}")
        if not (math.isfinite(s) and 0 < s <= threading.TIMEOUT_MAX):
            raise InvalidArgumentError(
                f"retry_interval_s must be > 0 and at most {threading.TIMEOUT_MAX:g} "
                f"(threading.TIMEOUT_MAX), got {s}"
            )
        if not isinstance(self.background, bool):
            raise InvalidTypeError(f"background must be a bool, got {self.background!r}")


def _check_bound(n: object) -> None:
    """Raise unless ``n`` is an int > 0 (a backlog's ``max_entries``)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidTypeError(f"max_entries must be an int, got {n!r}")
    if n <= 0:
        raise InvalidArgumentError(f"max_entries must be > 0, got {n}")


@dataclass(frozen=True, slots=True)
class _Aged:
    """A failed publish waiting: its age (smaller is older) and its entry."""

    age: int
    entry: Entry


def _age(aged: _Aged) -> int:
    return aged.age


class PublishBacklog:
    """The failed publishes waiting for the store, oldest first, at most ``max_entries``
    (one key: its latest entry). Each has an age (when it first failed; a retry that fails
    again keeps it), so the order and the bound follow ``models.backlog`` however a retry's
    outcomes arrive. Thread-safe; every method O(its arguments), ``take`` O(n), ``note``
    O(n) when a retry came back. A bound that is not an int > 0 raises InvalidTypeError /
    InvalidArgumentError, as ``RepublishPolicy``'s."""

    def __init__(self, max_entries: int) -> None:
        _check_bound(max_entries)  # InvalidTypeError / InvalidArgumentError, as the policy's
        self._max = max_entries
        self._waiting: OrderedDict[str, _Aged] = OrderedDict()  # ages increasing
        self._retrying: dict[str, _Aged] = {}  # taken by ``take``, not yet ended; oldest first
        self._ages = 0  # the last age given
        self._forgotten: set[str] = set()  # retries in flight dropped as the oldest
        self._answered = False  # an OK publish was noted while retries were in flight
        self._lock = new_lock(BACKLOG_LEVEL, "publish backlog lock")
        self.dropped = 0  # the oldest, dropped for a newer one beyond ``max_entries``
        self.stale = 0  # evicted, removed or quarantined before their retry: never published

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._retrying)

    def counts(self) -> tuple[int, int, int]:
        """``(len(self), dropped, stale)`` read together (under one hold of the lock), so
        ``EmbeddingCache.stats()`` never shows a drop without the failure that caused it. O(1)."""
        with self._lock:
            return len(self._waiting) + len(self._retrying), self.dropped, self.stale

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken backlog invariant: at most
        ``max_entries`` publishes waiting or in flight, and at most as many dropped retries
        still in flight (``marks``); each key once, waiting, in flight or dropped in flight,
        under its own entry; the waiting ones in age order, none newer than the last age
        given. O(n)."""
        with self._lock:
            waiting, retrying, forgotten = self._waiting, self._retrying, self._forgotten
            if len(waiting) + len(retrying) > self._max:
                raise InvariantError(
                    f"publish backlog: {len(waiting)} waiting and {len(retrying)} in flight "
                    f"pass its bound of {self._max}"
                )
            if len(forgotten) > self._max:
                raise InvariantError(
                    f"publish backlog: {len(forgotten)} dropped retries in flight pass its "
                    f"bound of {self._max}"
                )
            if twice := (waiting.keys() & retrying.keys()) | (forgotten & (
                waiting.keys() | retrying.keys()
            )):  # fmt: skip
                raise InvariantError(f"publish backlog: keys held twice: {twice}")
            for key, aged in [*waiting.items(), *retrying.items()]:
                if aged.entry.key != key or not 0 < aged.age <= self._ages:
                    raise InvariantError(
                        f"publish backlog: key {key!r} holds {aged.entry.key!r}'s entry or an "
                        f"age never given ({aged.age}; the last given: {self._ages})"
                    )
            ages = [a.age for a in waiting.values()]
            if any(older >= newer for older, newer in itertools.pairwise(ages)):
                raise InvariantError(f"publish backlog: waiting out of age order: {ages}")

    @property
    def marks(self) -> int:
        """Retries in flight that the bound dropped (each forgotten when its retry ends or
        does not start): at most ``max_entries``. O(1)."""
        with self._lock:
            return len(self._forgotten)

    def note(self, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]) -> bool:
        """Ended publishes: each FAILED one waits (retries that failed go back to the oldest
        end, in their age order); an OK one leaves the backlog if it waited (the store holds
        it); an UNKNOWN one never waits (its entry is quarantined). Returns whether the
        republisher should retry all that waits now: a publish ended OK (the store answers)
        while publishes wait, or failed retries came back after an OK publish was noted
        while they were in flight. With none waiting there is nothing to retry, so the
        republisher is not woken: an OK publish, the common case, costs no thread wake-up.
        (A failure noted by another I/O thread just after is retried by the next OK publish,
        or by the probe.)"""
        ok = False
        with self._lock:
            waiting, retrying = self._waiting, self._retrying
            back: dict[str, _Aged] = {}
            for entry, outcome in zip(entries, outcomes, strict=True):
                key = entry.key
                if key in self._forgotten:  # a retry dropped while in flight: it ends here
                    self._forgotten.discard(key)
                    ok = ok or outcome is TransferOutcome.OK
                    continue
                retried = retrying.pop(key, None)  # (a retry writes the key's entry)
                if outcome is TransferOutcome.OK:
                    ok = True
                    waiting.pop(key, None)  # (published by a request while it waited)
                    back.pop(key, None)
                elif outcome is TransferOutcome.FAILED:
                    if retried is not None:
                        back[key] = _Aged(retried.age, entry)
                    else:
                        waiting.pop(key, None)
                        self._ages += 1
                        waiting[key] = _Aged(self._ages, entry)
            if back:  # older than what failed since they were taken: merged in by age
                fresh = sorted((a for k, a in back.items() if k not in waiting), key=_age)
                merged = heapq.merge(fresh, waiting.values(), key=_age)  # (a newer failure wins)
                self._waiting = waiting = OrderedDict((a.entry.key, a) for a in merged)
            while len(waiting) + len(retrying) > self._max:
                oldest_retry = next(iter(retrying.values()), None)
                oldest_wait = next(iter(waiting.values()), None)
                if oldest_wait is None or (
                    oldest_retry is not None and oldest_retry.age < oldest_wait.age
                ):
                    assert oldest_retry is not None
                    key = oldest_retry.entry.key
                    del retrying[key]
                    self._forgotten.add(key)
                else:
                    waiting.popitem(last=False)
                self.dropped += 1
            again = bool(back) and self._answered  # (sent before the store answered)
            self._answered = bool(retrying) and (ok or self._answered)
            return (ok or again) and bool(waiting)

    def take(self, limit: int | None = None) -> list[Entry]:
        """The ``limit`` oldest waiting entries (None: all), oldest first, now being retried
        (each then ends in ``note``, ``skipped`` or ``requeue``); none while a retry is still
        in flight, the bound's dropped ones included: one retry at a time, so those that fail
        go back older than every waiting entry and the bound drops them first, the oldest
        first, and ``marks`` stays at most ``max_entries``. O(taken)."""
        with self._lock:
            if self._retrying or self._forgotten:
                return []
            waiting = self._waiting
            n = len(waiting) if limit is None else min(limit, len(waiting))
            taken = [waiting.popitem(last=False)[1] for _ in range(n)]
            if taken:
                self._answered = False  # (this retry follows the answer)
            self._retrying.update((a.entry.key, a) for a in taken)
            return [a.entry for a in taken]

    def skipped(self, entries: Sequence[Entry], started: Sequence[bool]) -> None:
        """Retries that did not start (the entry is gone, busy or quarantined): forgotten."""
        with self._lock:
            for entry, begun in zip(entries, started, strict=True):
                if begun:
                    continue
                if self._retrying.pop(entry.key, None) is not None:
                    self.stale += 1
                self._forgotten.discard(entry.key)

    def requeue(self, entries: Sequence[Entry]) -> None:
        """Taken entries whose retry could not run (the cache refused the step): back, oldest."""
        self.note(entries, [TransferOutcome.FAILED] * len(entries))


class Republisher:
    """The background thread of one cache's backlog. ``retry(limit)`` is the cache's own retry
    of the ``limit`` oldest (None: all; a bound method, held weakly: a cache dropped without
    ``close()`` ends its thread)."""

    def __init__(
        self,
        policy: RepublishPolicy,
        backlog: PublishBacklog,
        retry: Callable[[int | None], object],
    ) -> None:
        self._policy = policy
        self._backlog = backlog
        self._retry = weakref.WeakMethod(retry)
        self._wake = threading.Event()
        self._answered = False  # a publish ended OK since the last retry
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="embcache-republish", daemon=True)
        self._thread.start()

    def store_answered(self) -> None:
        """A publish ended OK: retry all that waits now rather than probe at the next interval."""
        self._answered = True
        self._wake.set()

    def stop(self) -> None:
        """Stop and wait for a retry in progress to be handed to the I/O pool."""
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._policy.retry_interval_s)
            self._wake.clear()
            answered, self._answered = self._answered, False
            if self._stop:
                return
            retry = self._retry()  # (asked at every wake: a cache dropped with nothing waiting)
            if retry is None:
                return  # the cache is gone
            try:
                if len(self._backlog):
                    retry(None if answered else 1)
            except ClosedError:
                return
            except Exception:  # kept waiting; tried again at the next interval
                log.warning("retrying failed publishes raised", exc_info=True)
            del retry  # (not held across the wait: the cache may be dropped meanwhile)
