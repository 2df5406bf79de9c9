"""``EmbeddingCache``: configuration and lifecycle around the pure core.

Theory of operation. The core (``embcache.core.cache_core.CacheCore``) holds every entry, pin,
wait and range and composes the DESIGN.md actions into a request's steps; the step runner
(``embcache.driver.runner.StepRunner``) holds the lock around it, runs one step at a time and
carries out each step's ``Effects`` (wake-ups, poisoning, trace delivery, store reads and writes
on the I/O pool). ``EmbeddingCache`` builds both from its arguments, holds the runner as the
public ``runner`` and keeps what outlives a step: the fencer, the publish backlog and its
republisher, and ``close``. Its methods check their arguments and run steps through
``runner.run``; every ``Request`` holds the same runner. Read-only queries (``stats``,
``entry_state``, ``snapshot``, ``sizes``) take the runner's lock around ``core.queries``.

Where a test needs to control the asynchronous parts, it passes them in: ``io_executor`` (what
runs the store reads and writes: a queue a test drains one task at a time) and ``new_event``
(how a waiting request's Event is made: one a deterministic scheduler controls).

Lock hierarchy: the cache lock is level 1; requests take no lock of their own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from embcache.core.allocator import BestFitAllocator, check_int
from embcache.core.cache_core import CacheCore
from embcache.core.entries import Entry, FenceSnapshot, RequestState
from embcache.core.lifecycle import EntryState
from embcache.core.outcomes import ItemStatus, TransferOutcome
from embcache.core.policy import Policy, as_policy, checked_work
from embcache.core.stats import CacheStats
from embcache.driver.backlog import PublishBacklog, Republisher, RepublishPolicy
from embcache.driver.fencing import FencePolicy, Fencer
from embcache.driver.global_store import GlobalStore
from embcache.driver.item import Item, check_key
from embcache.driver.locks import CACHE_LEVEL, assert_unlocked, new_lock
from embcache.driver.poison import poison_requested
from embcache.driver.pool import make_pool
from embcache.driver.request import Request
from embcache.driver.runner import IOExecutor, StepRunner
from embcache.driver.trace import TraceOutbox, TraceSink
from embcache.errors import ClosedError, InvalidArgumentError, InvalidTypeError

__all__ = [
    "CacheSnapshot",
    "CacheStats",
    "EmbeddingCache",
    "FencePolicy",
    "IOExecutor",
    "RepublishPolicy",
    "TraceSink",
]
log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_REPUBLISH = RepublishPolicy()  # ``republish``'s default: ignored without a store


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """A consistent copy of the core's state (``EmbeddingCache.snapshot``): the arguments of
    ``embcache.core.invariants.check_core``, none of them shared with the cache."""

    entries: dict[str, Entry]  # key -> a copy of its entry (state, range, holders, waiters...)
    requests: dict[str, RequestState]  # open requests: copies of their holds, waits, ...
    eviction_order: list[str]  # the idle READY keys, the next victim first
    evictable_bytes: int
    allocator: BestFitAllocator  # a copy: free_blocks(), allocations(), ...
    pinned_since: dict[str, float]  # pinned key -> when its pins began (the cache's clock)
    quarantine: dict[str, float]  # QUARANTINED key -> since when

class EmbeddingCache:
    """An embedding cache over one pool, optionally backed by a global store.

    ``capacity_bytes`` is the pool size (a multiple of ``alignment``). ``store=None`` (the
    default) means no global tier: lookups ask no store, inserts publish nothing, and the pool
    is the whole cache, so ``capacity_bytes`` bounds every byte of payload it keeps. The pool
    is a uint8 tensor, pinned when CUDA is available unless ``pin_memory=False``, registered
    with the store (if any) once. ``trace``, when given, receives one
    event dict per action, in ``seq`` order. ``policy`` shapes the eviction order and may refuse
    inserts that would evict (``embcache.core.policy``: a name, "adaptive-work" by default, or a
    ``Policy``). ``auto_fence`` says when the cache fences by itself (``embcache.driver.fencing``;
    None: only ``fence()`` does). ``poison_freed`` (default: ``EMBCACHE_POISON``) is a debug
    mode that overwrites every freed range (``embcache.driver.poison``). ``pool``, when given, is
    the pool itself (``embcache.driver.pool.make_pool``; shared memory: see
    ``embcache.driver.request``). ``republish`` bounds the publishes that failed and are tried
    again when the store answers (``embcache.driver.backlog``; None: never tried again); with
    ``store=None`` there is nothing to publish: a policy given then is refused
    (InvalidArgumentError, nothing changed), the default one is ignored.
    ``fence_gate``, when given, is asked by every fence once the store's fence returned:
    False means a writer outside the cache (an in-place fill's, ``embcache.driver.request``) may
    still write a quarantined range, and the fence frees nothing (it is tried again later).

    ``io_executor`` runs the store reads and writes (default: a ``ThreadPoolExecutor`` of
    ``io_workers`` threads); ``new_event`` makes the Event a request waiting on a load blocks
    on (default: ``threading.Event``). Both are the cache's to use and to shut down
    (``close()`` calls ``io_executor.shutdown(wait=True)``): give one the cache alone uses.
    They are how a test controls the asynchronous parts (a queue it runs task by task, events
    a deterministic scheduler owns); a deployment has no reason to pass them."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        store: GlobalStore | None = None,
        alignment: int = 256,
        max_eviction_batch: int = 100,
        enable_eviction: bool = True,
        pin_memory: bool | None = None,
        io_workers: int = 4,
        trace: TraceSink | None = None,
        policy: str | Policy = "adaptive-work",
        auto_fence: FencePolicy | None = FencePolicy(),  # noqa: B008 (frozen: shared is fine)
        poison_freed: bool | None = None,
        pool: torch.Tensor | None = None,
        io_executor: IOExecutor | None = None,
        new_event: Callable[[], threading.Event] = threading.Event,
        republish: RepublishPolicy | None = DEFAULT_REPUBLISH,
        fence_gate: Callable[[], bool] | None = None,
    ) -> None:
        check_int("capacity", capacity_bytes)  # here, not in the core: see RangeAllocator
        check_int("alignment", alignment)
        for name, value in (("max_eviction_batch", max_eviction_batch), ("io_workers", io_workers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidTypeError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {value}")
        if isinstance(alignment, int) and not isinstance(alignment, bool) and alignment < 16:
            raise InvalidArgumentError(
                f"alignment must be >= 16 so every dtype can view the pool, got {alignment}"
            )
        if store is not None and not isinstance(store, GlobalStore):
            raise InvalidTypeError(f"store must implement GlobalStore, got {type(store).__name__}")
        if auto_fence is not None and not isinstance(auto_fence, FencePolicy):
            raise InvalidTypeError(f"auto_fence must be a FencePolicy or None, got {auto_fence!r}")
        if io_executor is not None and not (
            callable(getattr(io_executor, "submit", None))
            and callable(getattr(io_executor, "shutdown", None))
        ):
            raise InvalidTypeError(
                f"io_executor must have submit and shutdown (an Executor), got {io_executor!r}"
            )
        if republish is not None and not isinstance(republish, RepublishPolicy):
            raise InvalidTypeError(
                f"republish must be a RepublishPolicy or None, got {republish!r}"
            )
        if store is None and republish is not None and republish is not DEFAULT_REPUBLISH:
            raise InvalidArgumentError(
                f"republish={republish!r} needs a store: without one nothing is published, so "
                "no publish fails and waits (pass a store, or republish=None)"
            )
        if fence_gate is not None and not callable(fence_gate):
            raise InvalidTypeError(f"fence_gate must be callable, got {fence_gate!r}")
        if not callable(new_event):
            raise InvalidTypeError(f"new_event must make an Event, got {new_event!r}")
        core = CacheCore(
            capacity_bytes,
            alignment,
            max_eviction_batch,
            enable_eviction=enable_eviction,
            trace=trace is not None,
            clock=time.monotonic,
            policy=(chosen := as_policy(policy)),
            record_freed=poison_requested() if poison_freed is None else poison_freed,
        )
        self._uses_work = bool(getattr(chosen, "records_work", False))
        self._capacity = capacity_bytes
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        pool_tensor = make_pool(capacity_bytes, pin, pool)
        if store is not None:
            store.register_buffer(pool_tensor)
        self._closed = False  # set by close(): the driver's own threads and retries end
        self._backlog: PublishBacklog | None = None
        self._republisher: Republisher | None = None
        if store is not None and republish is not None:
            self._backlog = PublishBacklog(republish.max_entries)
        self.runner = StepRunner(
            core,
            pool_tensor,
            store=store,
            lock=new_lock(CACHE_LEVEL, "cache lock"),
            io=(
                concurrent.futures.ThreadPoolExecutor(io_workers, "embcache-io")
                if io_executor is None
                else io_executor
            ),
            new_event=new_event,
            outbox=None if trace is None else TraceOutbox(trace),
            published=None if self._backlog is None else self._published,
        )
        if self._backlog is not None and republish is not None and republish.background:
            self._republisher = Republisher(republish, self._backlog, self.retry_publishes)
        self._fence_gate = fence_gate
        self._fence_policy = auto_fence
        self._fencer = (
            None if auto_fence is None else Fencer(auto_fence, self._fence_due, self.fence)
        )
        self.runner.run(core.start)  # Init

    # ------------------------------------------------------------------ public API
    @property
    def capacity(self) -> int:
        """Pool size in bytes."""
        return self._capacity

    @property
    def uses_work(self) -> bool:
        """Whether the policy admits by encoder work (``insert``'s ``work``; else unused)."""
        return self._uses_work

    @property
    def pool(self) -> torch.Tensor:
        """The pool tensor (registered with the store)."""
        return self.runner.pool

    @property
    def store(self) -> GlobalStore | None:
        """The global store this cache reads from and publishes to; None: no global tier."""
        return self.runner.store

    def request(self, request_id: str) -> Request:
        """Open a request; use it as a context manager so leaving it releases everything."""
        if type(request_id) is not str or not request_id:
            _request_id(request_id)  # raises
        runner = self.runner
        return Request(runner, runner.run(runner.core.open_request, request_id))

    def lookup(
        self, request_id: str, items: Sequence[Item], *, prefetch: bool = True,
        reserve_misses: bool = False,
    ) -> tuple[Request, list[ItemStatus]]:  # fmt: skip
        """``request(request_id)`` then its ``lookup(items, prefetch=prefetch,
        reserve_misses=reserve_misses)``, in one step when no store is asked: the request
        (use it as a context manager) and the statuses. O(items)."""
        if type(request_id) is not str or not request_id:
            _request_id(request_id)  # raises
        return Request.open(self.runner, request_id, items, prefetch, reserve_misses)

    def open_lookup(
        self, request_id: str, items: Sequence[Item], *, prefetch: bool = True
    ) -> tuple[Request, list[int | None] | None]:
        """``request(request_id)``, ``lookup(items, prefetch=prefetch)`` and ``offsets()`` in
        one step when no store is to be asked; the offsets are None while the request waits on
        a load (``wait``, then ``offsets``). O(items)."""
        request, _ = self.lookup(request_id, items, prefetch=prefetch)
        return request, request.ready_offsets()

    def insert(
        self, keys: Sequence[str], tensors: Sequence[torch.Tensor], *, publish: bool = True,
        work: Sequence[float] | None = None,
    ) -> list[bool]:  # fmt: skip
        """Insert fresh encoder outputs with no request open (as SGLang's ``store_to_pool_async``
        does): copy each absent key's tensor into the pool, keeping its dtype, and publish it
        when asked; True where cached. The new entries end idle (evictable), as a request's
        inserts do when it closes; a key present or being loaded is left alone (False).
        ``work``: as ``Request.insert``'s (each output's encoder seconds; None: unknown)."""
        if isinstance(keys, str) or len(keys) != len(tensors):
            raise InvalidArgumentError("insert takes a list of keys and a list of as many tensors")
        items = [Item.of(k, t) for k, t in zip(keys, tensors, strict=True)]  # (checks the key)
        seconds = None if work is None else checked_work(work, items)
        runner = self.runner
        core = runner.core
        rs, fills = runner.run(core.begin_insert, items, request=None, hand_out=False)
        outcomes, error = runner.views.copy_in([(e, tensors[i]) for i, e in fills])
        results = runner.run(
            core.end_inserts, rs, fills, outcomes, count=len(items),
            publish=publish and runner.store is not None, close=True, work=seconds,
        )  # fmt: skip
        if error is not None:
            raise error
        return results

    def remove(self, key: str) -> bool:
        """Remove ``key``: freed now if idle, else doomed and freed once idle. False if absent."""
        runner = self.runner
        return bool(runner.run(runner.core.remove, key=check_key(key)))

    def clear(self) -> int:
        """Remove every entry (busy ones are doomed); returns how many were removed or doomed."""
        runner = self.runner
        return runner.run(runner.core.remove, key=None)

    def fence(self) -> int:
        """Fence the store, then free the very entries quarantined before it; returns how many.
        Refused by the lock-order check: begins nothing; raising later: abandoned, re-raised;
        closed by ``fence_gate``: abandoned, 0."""
        assert_unlocked("store fence")
        runner = self.runner
        core, store = runner.core, runner.store
        begun: list[FenceSnapshot] = []  # the snapshot, even if delivering its event raises
        try:
            runner.run(core.begin_fence, begun)
            if store is not None:
                store.fence()
            gate = self._fence_gate
            clear = gate is None or gate()  # False: an outside writer may still write
        except BaseException:
            if begun:
                runner.run(core.end_fence, begun[0], ok=False)
            raise
        return runner.run(core.end_fence, begun[0], ok=clear)

    def close(self) -> None:
        """Stop taking requests, finish transfers in flight; the store is left to its owner.
        Failed publishes still waiting in the backlog are never written: logged as a warning
        with their count (``stats().publish_backlog`` keeps it)."""
        runner = self.runner
        if not runner.run(runner.core.close):
            return
        self._closed = True
        assert_unlocked("waiting for I/O workers")
        if self._fencer is not None:
            self._fencer.stop()
        if self._republisher is not None:
            self._republisher.stop()
        runner.io.shutdown(wait=True)
        if self._backlog is not None and (left := len(self._backlog)):
            log.warning("closed with %d failed publishes never written to the store", left)

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entry_state(self, key: str) -> EntryState:
        """The state of ``key``'s entry (ABSENT when there is none)."""
        check_key(key)
        runner = self.runner
        with runner.lock:
            return runner.core.queries.entry_state(key)

    def entry_states(self, keys: Sequence[str]) -> list[EntryState]:
        """``entry_state`` of each of ``keys``, read under one hold of the lock. O(keys)."""
        for key in keys:
            if type(key) is not str or not key:  # (``check_key``'s test, inline: no call per key)
                check_key(key)
        runner = self.runner
        with runner.lock:
            state = runner.core.queries.entry_state
            return [state(key) for key in keys]

    def stats(self) -> CacheStats:
        """A consistent snapshot. O(entries)."""
        runner = self.runner
        with runner.lock:
            stats = runner.core.queries.stats(time.monotonic())
        backlog = self._backlog
        if backlog is None:
            return stats
        size, dropped, stale = backlog.counts()
        return dataclasses.replace(
            stats, publish_backlog=size, publish_backlog_dropped=dropped,
            publish_backlog_stale=stale,
        )  # fmt: skip

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken DESIGN.md invariant, then the
        first broken invariant of the publish backlog (``PublishBacklog.check_invariants``;
        checked after the cache lock is released: its lock is a leaf). O(n log n)."""
        runner = self.runner
        with runner.lock:
            runner.core.queries.check_invariants()
        if self._backlog is not None:
            self._backlog.check_invariants()

    def snapshot(self) -> CacheSnapshot:
        """A consistent copy of the core's state (entries, open requests, eviction order,
        allocator, pin times, quarantine), taken in one locked step, for debugging and for
        checking the state from outside (against a reference model, or ``check_core`` over a
        copy). Nothing in it is shared with the cache. O(entries + requests)."""
        runner = self.runner
        with runner.lock:
            core = runner.core.queries
            return CacheSnapshot(
                entries={key: entry.copy() for key, entry in core.entries.items()},
                requests={r: rs.copy() for r, rs in core.requests.items()},
                eviction_order=core.eviction_order(),
                evictable_bytes=core.evictable_bytes,
                allocator=core.allocator_copy(),
                pinned_since=dict(core.pinned_since),
                quarantine=dict(core.quarantine),
            )

    def sizes(self) -> dict[str, int]:
        """How much each container bounded by the open requests or by a constant holds
        (embcache/DESIGN.md, "Memory bounds"), for watching memory: ``wakeups`` (open requests
        that waited on a load), ``async_waiters`` (their pending ``wait_async`` futures),
        ``fences_in_flight``, ``shapes`` (interned shapes), ``trace_batches`` (trace events
        handed in and not yet delivered), ``typed_views`` and ``view_bases`` (the pool's
        views), ``strides`` (the process-wide strides cache) and ``backlog_marks`` (failed
        publishes' retries in flight that the backlog's bound dropped). O(open requests)."""
        runner = self.runner
        with runner.lock:
            sizes = {
                "wakeups": len(runner.wakeups),
                "async_waiters": runner.wakeups.futures_count(),
                "fences_in_flight": runner.core.queries.fences_in_flight,
                "shapes": runner.core.queries.shapes,
            }
        sizes["trace_batches"] = runner.trace_batches()
        sizes["backlog_marks"] = 0 if self._backlog is None else self._backlog.marks
        return sizes | runner.views.sizes()

    # ------------------------------------------------------------------ what outlives a step
    def _published(self, entries: list[Entry], outcomes: list[TransferOutcome]) -> None:
        """The runner's report of publishes that ended (no lock held): failed ones wait in
        the backlog, and the republisher (when it runs) wakes when the backlog says a retry
        is due."""
        backlog, republisher = self._backlog, self._republisher
        if backlog is not None and backlog.note(entries, outcomes) and republisher:
            republisher.store_answered()

    def retry_publishes(self, limit: int | None = None) -> int:
        """Publish again, now, the ``limit`` oldest failed publishes waiting in the backlog
        (None: all; ``embcache.driver.backlog``): the republisher thread's step, for a cache
        built with ``RepublishPolicy(background=False)`` (or any other). When every one taken
        was evicted, removed or quarantined since (stale: dropped unwritten), the next oldest
        are taken at once, until a write starts or none waits: a probe (``limit`` 1) writes
        the oldest live entry, however many stale ones are older. Returns how many writes
        started; each ends on the I/O pool as any publish does. 0 without a backlog, with
        ``limit`` 0, or while a retry is in flight (one at a time). Raises InvalidTypeError /
        InvalidArgumentError for a ``limit`` that is not None or an int >= 0, and ClosedError
        once the cache is closed (backlog or not; entries taken by a retry the close
        interrupted wait again), each changing nothing. O(retried + stale)."""
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise InvalidTypeError(f"limit must be an int or None, got {limit!r}")
            if limit < 0:
                raise InvalidArgumentError(f"limit must be >= 0, got {limit}")
        if self._closed:
            raise ClosedError("the cache is closed: its failed publishes are not retried")
        backlog = self._backlog
        if backlog is None:
            return 0
        while entries := backlog.take(limit):  # (each turn takes out at least one)
            try:
                runner = self.runner
                keys = [e.key for e in entries]
                started = runner.run(
                    runner.core.publish, keys, request=None, store=True, entries=entries
                )
            except BaseException:
                backlog.requeue(entries)
                raise
            backlog.skipped(entries, started)
            if any(started):
                return sum(started)
        return 0

    def _fence_due(self, now: float) -> bool:
        """Whether the automatic fence should run now (the fencer's question)."""
        policy, capacity = self._fence_policy, self._capacity
        assert policy is not None
        max_bytes = int(policy.max_fraction * capacity)
        runner = self.runner
        with runner.lock:
            return runner.core.queries.fence_due(now, max_bytes, policy.max_age_s)

    def __repr__(self) -> str:
        runner = self.runner
        with runner.lock:
            entries = len(runner.core.queries.entries)
        return f"EmbeddingCache(capacity={self._capacity}, entries={entries})"


def _request_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidTypeError(f"request_id must be a str, got {request_id!r}")
    if not request_id:
        raise InvalidArgumentError("request_id must be a non-empty str")
    return request_id

