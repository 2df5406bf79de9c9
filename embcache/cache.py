"""``EmbeddingCache``: the driver around the pure core (``embcache.core.cache_core.CacheCore``).

Theory of operation. The core holds every entry, pin, wait and range and takes the DESIGN.md
actions; this driver owns everything else: the lock that serializes calls into the core, the
pool tensor and its zero-copy views, the payload copies of inserts, the I/O thread pool that
runs store reads and publishes, and the wake-ups of waiting threads and asyncio tasks. Every
call into the core happens under the cache lock; everything slow happens between calls with no
lock held: store calls run on the I/O pool and report back through ``end_load``/``end_publish``;
payload copies run in the caller's thread while the entry is LOADING (for an insert) or pinned
(for a read or publish), so the range cannot be freed or reused under them.

Lock hierarchy: the cache lock is level 1; the allocator's own lock (level 2) is taken inside
it. Requests never take a lock of their own. A waiting request is woken in ``_signal``, a short
hold of the cache lock after the action's own: its Event is set there, under the lock, only if
nothing is pending any more (so a late wake-up cannot end a newer wait); asyncio futures are
resolved after the lock is released.

``Request`` (``embcache.request``) talks to this driver through the methods of the section
"the seam Request uses", each taking the request's core state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from embcache.core import protocol as steps
from embcache.core.cache_core import CacheCore
from embcache.core.entries import Entry, ItemLike, RequestState, TraceSink
from embcache.core.lifecycle import ABSENT, EntryState
from embcache.core.outcomes import ItemStatus, Reason, TransferOutcome
from embcache.core.policy import Policy, make_policy
from embcache.core.stats import CacheStats
from embcache.errors import (
    ClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    LockOrderError,
    RequestError,
)
from embcache.fencing import FencePolicy, Fencer
from embcache.item import Item, check_key
from embcache.locks import CACHE_LEVEL, HierarchyLock, assert_unlocked
from embcache.poison import PoisoningLock, poison_requested
from embcache.pool import make_pool
from embcache.request import Request
from embcache.store.base import GlobalStore, get_outcome, put_outcome
from embcache.store.inprocess import InProcessStore

__all__ = ["CacheStats", "EmbeddingCache", "FencePolicy", "TraceSink"]
log = logging.getLogger(__name__)

Future = tuple[asyncio.AbstractEventLoop, "asyncio.Future[bool]"]


@dataclass(eq=False, slots=True)
class Wakeup:
    """How one request is woken: an Event (set while nothing is pending) and asyncio futures.
    Made when the request first waits on a load; changed only under the cache lock."""

    event: threading.Event
    futures: list[Future] = field(default_factory=list)


class EmbeddingCache:
    """An embedding cache over one pool, optionally backed by a global store.

    ``capacity_bytes`` is the pool size (a multiple of ``alignment``). ``store=None`` uses an
    ``InProcessStore``. The pool is a uint8 tensor, pinned when CUDA is available unless
    ``pin_memory=False``, registered with the store once. ``trace``, when given, receives one
    event dict per action, in lock order. ``policy`` shapes the eviction order and may refuse
    inserts that would evict (``embcache.core.policy``: "lru", the default, or "tinylfu", or a
    ``Policy`` object). ``auto_fence`` says when the cache fences by itself
    (``embcache.fencing``; None: only ``fence()`` does). ``poison_freed`` (default: the
    ``EMBCACHE_POISON`` environment variable) is a debug mode that overwrites every freed range
    (``embcache.poison``). ``pool``, when given, is the pool itself instead of a new tensor
    (``embcache.pool.make_pool``: for example shared memory that other processes map).
    """

    _new_event = threading.Event  # how a waiting request's Event is made (tests schedule it)

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
        policy: str | Policy = "lru",
        auto_fence: FencePolicy | None = FencePolicy(),  # noqa: B008 (frozen: shared is fine)
        poison_freed: bool | None = None,
        pool: torch.Tensor | None = None,
    ) -> None:
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
        if not isinstance(policy, str) and not all(
            callable(getattr(policy, m, None)) for m in ("order", "record", "admit", "forget")
        ):
            raise InvalidTypeError(f"policy must be a name or a Policy object, got {policy!r}")
        if auto_fence is not None and not isinstance(auto_fence, FencePolicy):
            raise InvalidTypeError(f"auto_fence must be a FencePolicy or None, got {auto_fence!r}")
        self._core = CacheCore(
            capacity_bytes,
            alignment,
            max_eviction_batch,
            enable_eviction,
            trace=trace,
            clock=time.monotonic,
            policy=make_policy(policy) if isinstance(policy, str) else policy,
        )
        self._closed = False
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pool = make_pool(capacity_bytes, pin, pool)
        self._owns_store = store is None
        self._store: GlobalStore = InProcessStore() if store is None else store
        self._typed_pools: dict[torch.dtype, torch.Tensor] = {}  # the pool viewed as each dtype
        lock = HierarchyLock(CACHE_LEVEL, "cache lock")
        poison = poison_requested() if poison_freed is None else poison_freed
        self._lock = PoisoningLock(lock, self._core, self._pool) if poison else lock
        self._store.register_buffer(self._pool)
        self._io = concurrent.futures.ThreadPoolExecutor(io_workers, "embcache-io")
        self._fence_policy = auto_fence
        self._fencer = (
            None if auto_fence is None else Fencer(auto_fence, self._fence_due, self.fence)
        )

    # ------------------------------------------------------------------ public API
    @property
    def capacity(self) -> int:
        """Pool size in bytes."""
        return self._core.capacity

    @property
    def pool(self) -> torch.Tensor:
        """The pool tensor (registered with the store)."""
        return self._pool

    @property
    def store(self) -> GlobalStore:
        """The global store this cache reads from and publishes to."""
        return self._store

    def request(self, request_id: str) -> Request:
        """Open a request; use it as a context manager so leaving it releases everything."""
        if not isinstance(request_id, str):
            raise InvalidTypeError(f"request_id must be a str, got {request_id!r}")
        if not request_id:
            raise InvalidArgumentError("request_id must be a non-empty str")
        with self._lock:
            self._check_open()
            if request_id in self._core.requests:
                raise RequestError(f"request {request_id!r} is already open: ids must be unique")
            state = self._core.open_request(request_id)
        return Request(self, state)

    def remove(self, key: str) -> bool:
        """Remove ``key``: freed now if idle, else doomed and freed once idle. False if absent."""
        check_key(key)
        with self._lock:
            self._check_open()
            return self._core.remove(key)

    def clear(self) -> int:
        """Remove every entry (busy ones are doomed); returns how many were removed or doomed."""
        with self._lock:
            self._check_open()
            return sum(self._core.remove(key) for key in list(self._core.entries))

    def fence(self) -> int:
        """Fence the store, then free every range quarantined before the call (the very
        entries, not their keys: fences may overlap); returns how many."""
        with self._lock:
            self._check_open()
            snap = self._core.begin_fence()
        assert_unlocked("store fence")
        self._store.fence()
        with self._lock:
            return self._core.fence(snap)

    def close(self) -> None:
        """Stop taking requests, finish transfers in flight, close a store this cache created."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        assert_unlocked("waiting for I/O workers")
        if self._fencer is not None:
            self._fencer.stop()
        self._io.shutdown(wait=True)
        if self._owns_store:
            self._store.close()

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entry_state(self, key: str) -> EntryState:
        """The state of ``key``'s entry (ABSENT when there is none)."""
        check_key(key)
        with self._lock:
            entry = self._core.entries.get(key)
            return ABSENT if entry is None else entry.state

    def stats(self) -> CacheStats:
        """A consistent snapshot. O(entries)."""
        with self._lock:
            return self._core.stats(time.monotonic())

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken DESIGN.md invariant. O(n log n)."""
        with self._lock:
            self._core.check_invariants()

    # ------------------------------------------------------------------ the seam Request uses
    def lookup_items(
        self, rs: RequestState, items: Sequence[Item], prefetch: bool, reserve: bool
    ) -> list[ItemStatus]:
        """``Request.lookup``: one pass under the lock; misses ask the store (no lock held),
        then a second pass starts loads and reservations."""
        core = self._core
        with self._lock:
            self._check_request(rs)
            statuses = steps.lookup_all(core, rs, items)
            if not (prefetch or reserve) or all(s.reason is not Reason.NOT_FOUND for s in statuses):
                steps.record(core, rs, items, statuses)  # nothing to start: one pass will do
                self._note_pending(rs)
                return statuses
        pairs = zip(items, statuses, strict=True)
        misses = sorted({it.key for it, s in pairs if s.reason is Reason.NOT_FOUND})
        found: dict[str, bool] = {}
        store_error = False
        if prefetch:
            assert_unlocked("store exists")
            try:
                found = dict(zip(misses, self._store.exists(misses), strict=True))
            except Exception:
                store_error = True
        with self._lock:
            self._check_request(rs)
            loads = steps.start_misses(
                core, rs, items, statuses, found, reserve=reserve, store_error=store_error
            )
            steps.record(core, rs, items, statuses)
            self._note_pending(rs)
        if loads:
            self._io.submit(self._run_loads, loads)
        return statuses

    def insert(
        self, rs: RequestState, keys: Sequence[str], tensors: Sequence[torch.Tensor], publish: bool
    ) -> list[bool]:
        """``Request.insert``: BeginLoad, copy with no lock held, EndLoad, then publish."""
        if isinstance(keys, str) or len(keys) != len(tensors):
            raise InvalidArgumentError("insert takes a list of keys and a list of as many tensors")
        items = [Item.of(check_key(k), t) for k, t in zip(keys, tensors, strict=True)]
        with self._lock:
            self._check_request(rs)
            filling = steps.plan_insert(self._core, rs, items)
        outcomes, error = self._copy_in([(e, tensors[i]) for i, e in filling])
        with self._lock:
            results, notify = steps.finish_insert(self._core, filling, outcomes, len(items))
        self._signal(notify)
        if error is not None:
            raise error
        if publish:
            self._start_publishes(rs, [items[i].key for i, _ in filling if results[i]])
        return results

    def embeddings(self, rs: RequestState) -> list[torch.Tensor | None]:
        """``Request.embeddings``: a new zero-copy view per item ``rs`` holds, else None."""
        with self._lock:
            self._check_request(rs)
            ranges = steps.served(self._core, rs)
        return [None if r is None else self._view(*r) for r in ranges]

    def publish(self, rs: RequestState, keys: Sequence[str]) -> list[bool]:
        """``Request.publish``: start a write to the store of each key ``rs`` holds READY."""
        if isinstance(keys, str):
            raise InvalidTypeError("publish takes a list of keys, got a str")
        keys = [check_key(k) for k in keys]
        with self._lock:
            self._check_request(rs)
        return self._start_publishes(rs, keys)

    def fallback(self, rs: RequestState) -> tuple[list[int], list[Reason | None]]:
        """``Request.fallback_mask`` and ``fallback_reasons``."""
        with self._lock:
            self._check_request(rs)
            return steps.fallback(self._core, rs)

    def wait(self, rs: RequestState, timeout: float | None) -> bool:
        """``Request.wait``: block (no lock held) until nothing is pending; False on timeout."""
        assert_unlocked("request wait")
        wakeup = rs.wakeup  # None: this request never waited on a load, so nothing is pending
        return wakeup is None or bool(wakeup.event.wait(timeout))

    async def wait_async(self, rs: RequestState, timeout: float | None) -> bool:
        """``Request.wait_async``: like ``wait``, without blocking the event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        with self._lock:
            if not rs.pending():
                return True
            futures = rs.wakeup.futures
            futures.append((loop, future))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            with self._lock:
                if (loop, future) in futures:
                    futures.remove((loop, future))
            return False

    def close_request(self, rs: RequestState) -> None:
        """``Request.close``: end reservations, release every pin and wait. Idempotent."""
        with self._lock:
            if self._core.requests.get(rs.request_id) is not rs:
                return
            notify = steps.end_request(self._core, rs)
            if rs.wakeup is not None:  # someone may wait on rs itself
                notify.append(rs)
        if notify:
            self._signal(notify)

    # ------------------------------------------------------------------ I/O (no lock held)
    def _copy_in(
        self, filling: list[tuple[Entry, torch.Tensor]]
    ) -> tuple[list[TransferOutcome], BaseException | None]:
        """Copy fresh outputs into their LOADING ranges; a failure fails it and all after it."""
        assert_unlocked("payload copy")
        outcomes = [TransferOutcome.FAILED] * len(filling)
        with torch.no_grad():
            for i, (entry, tensor) in enumerate(filling):
                try:
                    self._view(entry.offset, entry).copy_(tensor)
                except BaseException as exc:
                    return outcomes, exc
                outcomes[i] = TransferOutcome.OK
        return outcomes, None

    def _start_publishes(self, rs: RequestState, keys: list[str]) -> list[bool]:
        with self._lock:
            entries = [self._core.publish(rs, k) for k in keys]
        started = [e for e in entries if e is not None]
        if started:
            self._io.submit(self._run_publishes, rs.request_id, started)
        return [e is not None for e in entries]

    def _run_loads(self, entries: list[Entry]) -> None:
        """Worker: read every entry from the store, then end each load and wake its waiters,
        whatever is raised on the way (an error leaves each outcome UNKNOWN, then re-raises
        unless it is the store's own)."""
        sizes = [_nbytes(e) for e in entries]
        outcomes = [TransferOutcome.UNKNOWN] * len(entries)  # until the store says otherwise
        try:
            assert_unlocked("store get_into")
            codes = self._store.get_into(
                [e.key for e in entries], [e.offset for e in entries], sizes
            )
            outcomes = [get_outcome(self._store, c, n) for c, n in zip(codes, sizes, strict=True)]
        except LockOrderError:
            log.error("store read on an I/O thread broke the lock order", exc_info=True)
            raise
        except Exception:
            pass  # the store failed: the reads may still land, so UNKNOWN
        finally:
            notify: list[RequestState] = []
            try:
                with self._lock:
                    for e, o in zip(entries, outcomes, strict=True):
                        notify += self._core.end_load(e, o, None)
            finally:
                self._signal(notify)

    def _run_publishes(self, request_id: str, entries: list[Entry]) -> None:
        """Worker: write every entry to the store, then end each publish, whatever is raised on
        the way (as ``_run_loads``)."""
        outcomes = [TransferOutcome.UNKNOWN] * len(entries)
        try:
            assert_unlocked("store put_from")
            codes = self._store.put_from(
                [e.key for e in entries],
                [e.offset for e in entries],
                [_nbytes(e) for e in entries],
            )
            if len(codes) == len(entries):
                outcomes = [put_outcome(self._store, c) for c in codes]
        except LockOrderError:
            log.error("store write on an I/O thread broke the lock order", exc_info=True)
            raise
        except Exception:
            pass  # the store failed: the writes may still read the ranges, so UNKNOWN
        finally:
            with self._lock:
                for e, o in zip(entries, outcomes, strict=True):
                    self._core.end_publish(request_id, e, o)

    def _signal(self, requests: list[RequestState]) -> None:
        """Wake requests with nothing pending. Called with no lock held."""
        assert_unlocked("waking requests")
        wake: list[Future] = []
        with self._lock:
            for rs in requests:
                wakeup = rs.wakeup
                if wakeup is not None and not rs.pending():
                    wakeup.event.set()
                    wake += wakeup.futures
                    wakeup.futures = []
        for loop, future in wake:
            with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
                loop.call_soon_threadsafe(_resolve, future)

    def _fence_due(self, now: float) -> bool:
        """Whether the automatic fence should run now (the fencer's question)."""
        assert self._fence_policy is not None
        max_bytes = int(self._fence_policy.max_fraction * self.capacity)
        with self._lock:
            return self._core.fence_due(now, max_bytes, self._fence_policy.max_age_s)

    # ------------------------------------------------------------------ helpers (lock held)
    def _note_pending(self, rs: RequestState) -> None:
        """After a lookup: clear rs's Event while it waits on a load, set it otherwise (only
        requests that ever wait get one)."""
        if rs.pending():
            if rs.wakeup is None:
                rs.wakeup = Wakeup(self._new_event())
            rs.wakeup.event.clear()
        elif rs.wakeup is not None:
            rs.wakeup.event.set()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed: create a new EmbeddingCache")

    def _check_request(self, rs: RequestState) -> None:
        if self._closed or self._core.requests.get(rs.request_id) is not rs:
            self._check_open()
            raise ClosedError(f"request {rs.request_id!r} is closed")

    def _view(self, offset: int, item: ItemLike | Entry) -> torch.Tensor:
        """``item``'s bytes at ``offset`` as a tensor of its shape and dtype (zero-copy)."""
        dtype: torch.dtype = item.dtype  # type: ignore[assignment]
        typed = self._typed_pools.get(dtype)
        if typed is None:  # one view of the whole pool per dtype; a race makes two, both valid
            typed = self._typed_pools.setdefault(dtype, self._pool.view(dtype))
        return typed.as_strided(item.shape, _strides(item.shape), offset // dtype.itemsize)

    def __repr__(self) -> str:
        return f"EmbeddingCache(capacity={self.capacity}, entries={len(self._core.entries)})"


def _nbytes(entry: Entry) -> int:
    """The payload bytes of ``entry`` (its range may be larger: rounded to the alignment)."""
    dtype: torch.dtype = entry.dtype  # type: ignore[assignment]
    return math.prod(entry.shape) * dtype.itemsize


def _resolve(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(True)


@functools.lru_cache(maxsize=1024)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major (contiguous) strides of ``shape``, in elements."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
