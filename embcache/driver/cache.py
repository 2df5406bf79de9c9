"""``EmbeddingCache``: the driver around the pure core (``embcache.core.cache_core.CacheCore``).

Theory of operation. The core holds every entry, pin, wait and range, takes the DESIGN.md
actions and composes them into a request's steps; this driver owns the rest: the lock around
the core, the pool and its views, the payload copies of inserts, the I/O threads that run store
reads and publishes, wake-ups, trace delivery and the poison debug mode.

One funnel per step: every core step goes through ``_run``, the one place that takes the lock
around the core. Under the lock it calls the step (which checks that the cache and the request
are open, raising ``ClosedError``), poisons the ranges it freed (debug mode, before the lock
goes, so no allocation can take them first) and arms, drops or fires wake-ups
(``embcache.driver.wakeups``, which lives under the lock); then, with no lock held, it hands the
trace events to the sink (``embcache.driver.trace.TraceOutbox``), resolves asyncio waiters, and
starts the step's store reads and writes on the I/O pool. Everything slow happens between steps:
store calls report back through the ``end_loads``/``end_publishes`` steps; payload copies run in the
caller's thread while the entry is LOADING (an insert) or pinned (a read or publish), so the
range cannot be freed or reused under them. Read-only queries (``stats``, ``entry_state``,
``snapshot``, ``sizes``) take the lock around a core query, and ``_wait_async`` around the
wake-ups alone.

Where a test needs to control the asynchronous parts, it passes them in: ``io_executor`` (what
runs the store reads and writes: a queue a test drains one task at a time) and ``new_event``
(how a waiting request's Event is made: one a deterministic scheduler controls).

Lock hierarchy: the cache lock is level 1; requests take no lock of their own. ``Request``
holds its own bodies and reaches this driver through a small typed port
(``embcache.driver.request.CachePort``: the funnel, the core, the store, the pool's views, the
wake-ups and their lock). The driver reads the core's state only inside the funnel, or under
the lock through the core's read-only ``queries``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, TypeVarTuple

import torch

from embcache.core.allocator import BestFitAllocator, check_int
from embcache.core.cache_core import CacheCore
from embcache.core.effects import Effects
from embcache.core.entries import Entry, FenceSnapshot, RequestState
from embcache.core.lifecycle import EntryState
from embcache.core.outcomes import ItemStatus, TransferOutcome
from embcache.core.policy import Policy, as_policy, checked_work
from embcache.core.stats import CacheStats
from embcache.driver.backlog import PublishBacklog, Republisher, RepublishPolicy
from embcache.driver.fencing import FencePolicy, Fencer
from embcache.driver.global_store import GlobalStore, get_outcome, put_outcome
from embcache.driver.item import Item, check_key
from embcache.driver.locks import CACHE_LEVEL, assert_unlocked, new_lock
from embcache.driver.poison import poison, poison_requested
from embcache.driver.pool import PoolViews, make_pool, payload_nbytes
from embcache.driver.request import Request, open_request
from embcache.driver.trace import TraceOutbox, TraceSink
from embcache.driver.wakeups import Future, Wakeups, resolve
from embcache.errors import InvalidArgumentError, InvalidTypeError, LockOrderError

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
Ts = TypeVarTuple("Ts")  # a step's arguments: mypy checks each against the step


class IOExecutor(Protocol):
    """What runs the cache's store reads and writes (``concurrent.futures.Executor`` is one):
    ``submit(fn, *args)`` runs ``fn(*args)`` later, on any thread but the caller's lock-free;
    ``shutdown(wait=True)`` returns once every task submitted has run."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> object: ...
    def shutdown(self, wait: bool = True) -> object: ...


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
    again when the store answers (``embcache.driver.backlog``; None: never tried again).
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
        republish: RepublishPolicy | None = RepublishPolicy(),  # noqa: B008 (frozen)
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
        if fence_gate is not None and not callable(fence_gate):
            raise InvalidTypeError(f"fence_gate must be callable, got {fence_gate!r}")
        if not callable(new_event):
            raise InvalidTypeError(f"new_event must make an Event, got {new_event!r}")
        self._core = CacheCore(
            capacity_bytes,
            alignment,
            max_eviction_batch,
            enable_eviction,
            trace=trace is not None,
            clock=time.monotonic,
            policy=(chosen := as_policy(policy)),
            record_freed=poison_requested() if poison_freed is None else poison_freed,
        )
        self._uses_work = bool(getattr(chosen, "records_work", False))
        self._capacity = capacity_bytes
        self._outbox = None if trace is None else TraceOutbox(trace)
        self._wakeups = Wakeups()
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pool = make_pool(capacity_bytes, pin, pool)
        self._store = store
        self._views = PoolViews(self._pool)
        self._view = self._views.view
        self._lock = new_lock(CACHE_LEVEL, "cache lock")
        if store is not None:
            store.register_buffer(self._pool)
        self._io: IOExecutor = (
            concurrent.futures.ThreadPoolExecutor(io_workers, "embcache-io")
            if io_executor is None
            else io_executor
        )
        self._new_event = new_event
        self._fence_gate = fence_gate
        self._fence_policy = auto_fence
        self._fencer = (
            None if auto_fence is None else Fencer(auto_fence, self._fence_due, self.fence)
        )
        self._backlog: PublishBacklog | None = None
        self._republisher: Republisher | None = None
        if store is not None and republish is not None:
            self._backlog = PublishBacklog(republish.max_entries)
            self._republisher = Republisher(republish, self._backlog, self._republish)
        self._run(self._core.start)  # Init

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
        return self._pool

    @property
    def store(self) -> GlobalStore | None:
        """The global store this cache reads from and publishes to; None: no global tier."""
        return self._store

    def request(self, request_id: str) -> Request:
        """Open a request; use it as a context manager so leaving it releases everything."""
        if type(request_id) is not str or not request_id:
            _request_id(request_id)  # raises
        return Request(self, self._run(self._core.open_request, request_id))

    def lookup(
        self, request_id: str, items: Sequence[Item], *, prefetch: bool = True,
        reserve_misses: bool = False,
    ) -> tuple[Request, list[ItemStatus]]:  # fmt: skip
        """``request(request_id)`` then its ``lookup(items, prefetch=prefetch,
        reserve_misses=reserve_misses)``, in one step when no store is asked: the request
        (use it as a context manager) and the statuses. O(items)."""
        return open_request(self, _request_id(request_id), items, prefetch, reserve_misses)

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
        seconds = checked_work(work, items)
        core = self._core
        rs, fills = self._run(core.begin_insert, None, items, False)
        outcomes, error = self._views.copy_in([(e, tensors[i]) for i, e in fills])
        publish = publish and self._store is not None
        results = self._run(
            core.end_inserts, rs, fills, outcomes, len(items), publish, True, False, False,
            seconds,
        )  # fmt: skip
        if error is not None:
            raise error
        return results

    def remove(self, key: str) -> bool:
        """Remove ``key``: freed now if idle, else doomed and freed once idle. False if absent."""
        return bool(self._run(self._core.remove, check_key(key)))

    def clear(self) -> int:
        """Remove every entry (busy ones are doomed); returns how many were removed or doomed."""
        return self._run(self._core.remove, None)

    def fence(self) -> int:
        """Fence the store, then free the very entries quarantined before it; returns how many.
        Refused by the lock-order check: begins nothing; raising later: abandoned, re-raised;
        closed by ``fence_gate``: abandoned, 0."""
        assert_unlocked("store fence")
        core = self._core
        begun: list[FenceSnapshot] = []  # the snapshot, even if delivering its event raises
        try:
            self._run(core.begin_fence, begun)
            if self._store is not None:
                self._store.fence()
            gate = self._fence_gate
            clear = gate is None or gate()  # False: an outside writer may still write
        except BaseException:
            if begun:
                self._run(core.end_fence, begun[0], False)
            raise
        return self._run(core.end_fence, begun[0], clear)

    def close(self) -> None:
        """Stop taking requests, finish transfers in flight; the store is left to its owner."""
        if not self._run(self._core.close):
            return
        assert_unlocked("waiting for I/O workers")
        if self._fencer is not None:
            self._fencer.stop()
        if self._republisher is not None:
            self._republisher.stop()
        self._io.shutdown(wait=True)

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entry_state(self, key: str) -> EntryState:
        """The state of ``key``'s entry (ABSENT when there is none)."""
        check_key(key)
        with self._lock:
            return self._core.queries.entry_state(key)

    def stats(self) -> CacheStats:
        """A consistent snapshot. O(entries)."""
        with self._lock:
            stats = self._core.queries.stats(time.monotonic())
        backlog = self._backlog
        if backlog is None:
            return stats
        return dataclasses.replace(
            stats,
            publish_backlog=len(backlog),
            publish_backlog_dropped=backlog.dropped,
            publish_backlog_stale=backlog.stale,
        )

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken DESIGN.md invariant. O(n log n)."""
        with self._lock:
            self._core.queries.check_invariants()

    def snapshot(self) -> CacheSnapshot:
        """A consistent copy of the core's state (entries, open requests, eviction order,
        allocator, pin times, quarantine), taken in one locked step, for debugging and for
        checking the state from outside (against a reference model, or ``check_core`` over a
        copy). Nothing in it is shared with the cache. O(entries + requests)."""
        with self._lock:
            core = self._core.queries
            return CacheSnapshot(
                entries={key: entry.copy() for key, entry in core.entries.items()},
                requests={r: rs.copy() for r, rs in core.requests.items()},
                eviction_order=core.eviction_order(),
                evictable_bytes=core.evictable_bytes,
                allocator=copy.deepcopy(core.allocator),
                pinned_since=dict(core.pinned_since),
                quarantine=dict(core.quarantine),
            )

    def sizes(self) -> dict[str, int]:
        """How much each container bounded by the open requests or by a constant holds
        (embcache/DESIGN.md, "Memory bounds"), for watching memory: ``wakeups`` (open requests
        that waited on a load), ``async_waiters`` (their pending ``wait_async`` futures),
        ``fences_in_flight``, ``shapes`` (interned shapes), ``trace_batches`` (trace events
        handed in and not yet delivered), ``typed_views`` and ``view_bases`` (the pool's
        views) and ``strides`` (the process-wide strides cache). O(open requests)."""
        with self._lock:
            sizes = {
                "wakeups": len(self._wakeups),
                "async_waiters": self._wakeups.futures_count(),
                "fences_in_flight": self._core.queries.fences_in_flight,
                "shapes": self._core.queries.shapes,
            }
        outbox = self._outbox
        sizes["trace_batches"] = 0 if outbox is None else outbox.waiting_batches()
        return sizes | self._views.sizes()

    # ------------------------------------------------------------------ I/O (no lock held)
    def _run_loads(self, entries: list[Entry]) -> None:
        """Worker: read every entry from the store, then end each load and wake its waiters,
        whatever is raised on the way (an error leaves each outcome UNKNOWN, then re-raises
        unless it is the store's own)."""
        store = self._store
        assert store is not None  # a load starts only from a store's answer
        sizes = [payload_nbytes(e) for e in entries]
        outcomes = [TransferOutcome.UNKNOWN] * len(entries)  # until the store says otherwise
        try:
            assert_unlocked("store get_into")
            codes = store.get_into([e.key for e in entries], [e.offset for e in entries], sizes)
            outcomes = [get_outcome(store, c, n) for c, n in zip(codes, sizes, strict=True)]
        except LockOrderError:
            log.error("store read on an I/O thread broke the lock order", exc_info=True)
            raise
        except Exception:
            pass  # the store failed: the reads may still land, so UNKNOWN
        finally:
            self._run(self._core.end_loads, entries, outcomes)

    def _run_publishes(self, request_id: str, entries: list[Entry]) -> None:
        """Worker: write every entry to the store, then end each publish, come what may."""
        store = self._store
        assert store is not None  # a publish starts only where there is a store
        outcomes = [TransferOutcome.UNKNOWN] * len(entries)
        try:
            assert_unlocked("store put_from")
            codes = store.put_from(
                [e.key for e in entries],
                [e.offset for e in entries],
                [payload_nbytes(e) for e in entries],
            )
            if len(codes) == len(entries):
                outcomes = [put_outcome(store, c) for c in codes]
        except LockOrderError:
            log.error("store write on an I/O thread broke the lock order", exc_info=True)
            raise
        except Exception:
            pass  # the store failed: the writes may still read the ranges, so UNKNOWN
        finally:
            self._run(self._core.end_publishes, request_id, entries, outcomes)
            backlog = self._backlog
            if backlog is not None and backlog.note(entries, outcomes):
                assert self._republisher is not None
                self._republisher.store_answered()

    def _republish(self, limit: int | None) -> None:
        """The republisher's retry: publish again the ``limit`` oldest failed publishes (None:
        all; ``CacheCore.publish`` with no request)."""
        backlog = self._backlog
        assert backlog is not None
        entries = backlog.take(limit)
        if not entries:
            return
        try:
            started = self._run(self._core.publish, None, [e.key for e in entries], True)
        except BaseException:
            backlog.requeue(entries)
            raise
        backlog.skipped(entries, started)

    def _fence_due(self, now: float) -> bool:
        """Whether the automatic fence should run now (the fencer's question)."""
        policy, capacity = self._fence_policy, self._capacity
        assert policy is not None
        max_bytes = int(policy.max_fraction * capacity)
        with self._lock:
            return self._core.queries.fence_due(now, max_bytes, policy.max_age_s)

    # ------------------------------------------------------------------ the funnel
    def _run(self, step: Callable[[*Ts], Effects[T]], /, *args: *Ts) -> T:
        """The one place that takes the cache lock around a core step, and carries out the
        step's ``Effects``. Under the lock: the step (which raises, changing nothing, if the
        cache or the request is closed), then the poisoning of the ranges it freed (debug
        mode: no allocation can take them first) and the wake-ups it names (an Event is set
        only while the core says nothing is pending). With no lock held: its trace events to
        the sink (in ``seq`` order across threads), its asyncio waiters resolved, its store
        reads and writes submitted to the I/O pool. Returns the step's result."""
        with self._lock:
            fx = step(*args)
            if fx.freed:
                poison(self._pool, fx.freed)
            futures: list[Future] | None = None
            if fx.waiting is not None:
                self._wakeups.note(fx.waiting, self._new_event)
            if fx.wake:
                futures = self._wakeups.wake(fx.wake)
            if fx.closed is not None:  # someone may wait on the closed request itself
                own = self._wakeups.close(fx.closed)
                futures = own if futures is None else futures + own
        if fx.events:
            assert self._outbox is not None
            self._outbox.deliver(list(fx.events))
        if fx.wake:
            assert_unlocked("waking requests")  # a caller's lock must not span a hand-off
        if futures:
            resolve(futures)
        if fx.loads:
            self._io.submit(self._run_loads, list(fx.loads))
        if fx.writes is not None:
            self._io.submit(self._run_publishes, *fx.writes)
        return fx.result

    def __repr__(self) -> str:
        with self._lock:
            entries = len(self._core.queries.entries)
        return f"EmbeddingCache(capacity={self._capacity}, entries={entries})"


def _request_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidTypeError(f"request_id must be a str, got {request_id!r}")
    if not request_id:
        raise InvalidArgumentError("request_id must be a non-empty str")
    return request_id

