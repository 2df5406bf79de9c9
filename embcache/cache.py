"""The cache controller: entries, pins, loads, publishes and eviction over one pool.

Theory of operation. Every change of shared state is one DESIGN.md action (``_lookup``,
``_begin_load``, ``_end_load``, ``_release``, ``_evict``, ``_remove``, ``_publish``,
``_end_publish``, ``_fence``, ``_open_request``, ``_close_request``), taken under the cache lock,
checked against the transition table of ``embcache.states`` before anything changes, and
traced as one event. Everything slow happens between actions with no lock held: store calls
run on an I/O thread pool and report back through ``_end_load``/``_end_publish``; payload
copies run in the caller's thread while the entry is LOADING (for an insert) or pinned (for a
read or publish), so the range cannot be freed or reused under them.

Lock hierarchy: the cache lock is level 1; the allocator's own lock (level 2) is taken inside
it. Requests never take a lock of their own. A waiting request is woken in ``_signal``, a short
hold of the cache lock after the action's own: its Event is set there, under the lock, only if
nothing is pending any more (so a late wake-up cannot end a newer wait); asyncio futures are
resolved after the lock is released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from embcache.allocator import Block, RangeAllocator
from embcache.errors import (
    ClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    RequestError,
)
from embcache.eviction import choose_victims
from embcache.item import Item, check_key
from embcache.locks import CACHE_LEVEL, HierarchyLock, assert_unlocked
from embcache.request import Request
from embcache.states import ABSENT, LOADING, QUARANTINED, READY, EntryState, Step, transition
from embcache.status import ItemStatus, Reason, Status
from embcache.store.base import GlobalStore, TransferOutcome, get_outcome, put_outcome
from embcache.store.inprocess import InProcessStore

HIT = ItemStatus(Status.HIT)  # statuses are immutable: the common ones are shared
LOADING_STATUS = ItemStatus(Status.LOADING)
RESERVED_STATUS = ItemStatus(Status.RESERVED)
MISSES = {reason: ItemStatus(Status.MISS, reason) for reason in Reason}
Holder = str | tuple[str, str]  # a request id, or ("publish", request id) for a publish pin
NOBODY: frozenset[Any] = frozenset()  # shared: an idle entry carries no set of its own


class TraceSink(Protocol):
    """Where trace events go: a list, or anything with ``append``."""

    def append(self, event: dict[str, Any], /) -> None: ...


@dataclass(eq=False, slots=True)
class Entry:
    """One key's entry. Mutated only under the cache lock."""

    item: Item
    offset: int
    size: int  # allocated bytes (rounded up to the alignment)
    from_store: bool  # a store read is (or was) filling it; else a request fills it
    state: EntryState = LOADING
    holders: frozenset[Holder] = NOBODY  # immutable values; every empty one is NOBODY
    waiters: frozenset[str] = NOBODY
    filler: str | None = None  # the request that must fill a LOADING entry not from the store
    doomed: bool = False
    tainted: bool = False  # a publish ended UNKNOWN: quarantine when the last pin goes
    publishing: bool = False
    pinned_since: float = 0.0

    @property
    def key(self) -> str:
        return self.item.key

    @property
    def pins(self) -> int:
        return len(self.holders)


@dataclass(eq=False, slots=True)
class RequestState:
    """A request's bookkeeping. Mutated only under the cache lock."""

    request_id: str
    items: list[Item] = field(default_factory=list)
    holds: set[str] = field(default_factory=set)
    waits: set[str] = field(default_factory=set)
    reserved: set[str] = field(default_factory=set)
    fallbacks: dict[str, Reason] = field(default_factory=dict)
    done: Any = None  # a threading.Event made when it first waits on a load; set while idle
    async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = field(
        default_factory=list
    )

    def pending(self) -> bool:
        """Whether it waits on a load that someone else fills (a store read or another's insert)."""
        return bool(self.waits) and not self.waits <= self.reserved


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache: occupancy, entries by state, pins and counters."""

    capacity_bytes: int
    allocated_bytes: int
    free_bytes: int
    largest_free_block: int
    fragmentation: float  # 1 - largest free block / free bytes (0 when empty or full)
    entries_by_state: dict[str, int]
    bytes_by_state: dict[str, int]
    pinned_entries: int
    pinned_bytes: int
    oldest_pin_age_s: float
    open_requests: int
    hits: int
    misses_by_reason: dict[str, int]
    fallbacks_by_reason: dict[str, int]
    loads_started: int
    loads_ok: int
    loads_failed: int
    loads_unknown: int
    inserts: int
    publishes_started: int
    publishes_ok: int
    publishes_failed: int
    publishes_unknown: int
    evictions: int
    evicted_bytes: int
    allocation_failures_by_reason: dict[str, int]
    single_flight_joins: int
    fences: int

    @property
    def entries(self) -> int:
        return sum(self.entries_by_state.values())


Notify = list[RequestState]


class EmbeddingCache:
    """An embedding cache over one pool, optionally backed by a global store.

    ``capacity_bytes`` is the pool size (a multiple of ``alignment``). ``store=None`` uses an
    ``InProcessStore``. The pool is a uint8 tensor, pinned when CUDA is available unless
    ``pin_memory=False``, registered with the store once. ``trace``, when given, receives one
    event dict per action, in lock order.
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
        self._allocator = RangeAllocator(capacity_bytes, alignment)
        self._lock = HierarchyLock(CACHE_LEVEL, "cache lock")
        self._max_batch = max_eviction_batch
        self._enable_eviction = enable_eviction
        self._trace = trace
        self._seq = 0
        self._entries: dict[str, Entry] = {}
        self._by_offset: dict[int, Entry] = {}
        self._lru: OrderedDict[str, Entry] = OrderedDict()
        self._evictable_bytes = 0
        self._requests: dict[str, RequestState] = {}
        self._counts: Counter[str] = Counter()
        self._closed = False
        self._owns_store = store is None
        self._store: GlobalStore = InProcessStore() if store is None else store
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pool = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin)
        self._typed_pools: dict[torch.dtype, torch.Tensor] = {}  # the pool viewed as each dtype
        self._store.register_buffer(self._pool)
        self._io = concurrent.futures.ThreadPoolExecutor(io_workers, "embcache-io")
        self._emit(
            "Init",
            None,
            capacity=capacity_bytes,
            alignment=alignment,
            max_eviction_batch=max_eviction_batch,
            enable_eviction=enable_eviction,
        )

    # ------------------------------------------------------------------ public API
    @property
    def capacity(self) -> int:
        """Pool size in bytes."""
        return self._allocator.capacity

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
            if request_id in self._requests:
                raise RequestError(f"request {request_id!r} is already open: ids must be unique")
            state = self._open_request(request_id)
        return Request(self, state)

    def remove(self, key: str) -> bool:
        """Remove ``key``: freed now if idle, else doomed and freed once idle. False if absent."""
        check_key(key)
        with self._lock:
            self._check_open()
            return self._remove(key)

    def clear(self) -> int:
        """Remove every entry (busy ones are doomed); returns how many were removed or doomed."""
        with self._lock:
            self._check_open()
            return sum(self._remove(key) for key in list(self._entries))

    def fence(self) -> int:
        """Fence the store, then free every range quarantined before the call; returns how many."""
        with self._lock:
            self._check_open()
            quarantined = [e for e in self._entries.values() if e.state is QUARANTINED]
        assert_unlocked("store fence")
        self._store.fence()
        with self._lock:
            return self._fence(quarantined)

    def close(self) -> None:
        """Stop taking requests, finish transfers in flight, close a store this cache created."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        assert_unlocked("waiting for I/O workers")
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
            entry = self._entries.get(key)
            return ABSENT if entry is None else entry.state

    def stats(self) -> CacheStats:
        """A consistent snapshot. O(entries)."""
        with self._lock:
            now = time.monotonic()
            by_state: Counter[str] = Counter()
            bytes_by_state: Counter[str] = Counter()
            pinned = [e for e in self._entries.values() if e.pins]
            for e in self._entries.values():
                by_state[e.state.name] += 1
                bytes_by_state[e.state.name] += e.size
            free = self._allocator.free_bytes
            largest = self._allocator.largest_free_block
            c = self._counts
            return CacheStats(
                capacity_bytes=self.capacity,
                allocated_bytes=self._allocator.allocated_bytes,
                free_bytes=free,
                largest_free_block=largest,
                fragmentation=(1.0 - largest / free) if free else 0.0,
                entries_by_state=dict(by_state),
                bytes_by_state=dict(bytes_by_state),
                pinned_entries=len(pinned),
                pinned_bytes=sum(e.size for e in pinned),
                oldest_pin_age_s=max((now - e.pinned_since for e in pinned), default=0.0),
                open_requests=len(self._requests),
                hits=c["hits"],
                misses_by_reason=_by_prefix(c, "miss:"),
                fallbacks_by_reason=_by_prefix(c, "fallback:"),
                loads_started=c["loads_started"],
                loads_ok=c["loads_ok"],
                loads_failed=c["loads_failed"],
                loads_unknown=c["loads_unknown"],
                inserts=c["inserts"],
                publishes_started=c["publishes_started"],
                publishes_ok=c["publishes_ok"],
                publishes_failed=c["publishes_failed"],
                publishes_unknown=c["publishes_unknown"],
                evictions=c["evictions"],
                evicted_bytes=c["evicted_bytes"],
                allocation_failures_by_reason=_by_prefix(c, "alloc_fail:"),
                single_flight_joins=c["joins"],
                fences=c["fences"],
            )

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken DESIGN.md invariant. O(n log n)."""
        with self._lock:
            self._check_invariants_locked()

    # ------------------------------------------------------------------ request entry points
    def _lookup_items(
        self, rs: RequestState, items: Sequence[Item], prefetch: bool, reserve: bool
    ) -> list[ItemStatus]:
        with self._lock:
            self._check_request(rs)
            statuses, new_misses = [], set()
            for item in items:
                status = self._lookup(rs, item)
                if status.reason is Reason.NOT_FOUND:
                    if item.nbytes > self.capacity:
                        status = MISSES[Reason.TOO_LARGE]
                    else:
                        new_misses.add(item.key)
                statuses.append(status)
            if not new_misses or not (prefetch or reserve):  # nothing to start: one pass will do
                self._record(rs, items, statuses)
                return statuses
        misses = sorted(new_misses)
        found: dict[str, bool] = {}
        store_error = False
        if prefetch:
            assert_unlocked("store exists")
            try:
                found = dict(zip(misses, self._store.exists(misses), strict=True))
            except Exception:
                store_error = True
        loads: list[Entry] = []
        with self._lock:
            self._check_request(rs)
            for i, item in enumerate(items):
                if statuses[i].reason is Reason.NOT_FOUND:
                    statuses[i] = self._start(rs, item, found.get(item.key, False), reserve, loads)
                    if statuses[i].reason is Reason.NOT_FOUND and store_error:
                        statuses[i] = MISSES[Reason.STORE_ERROR]
            self._record(rs, items, statuses)
        if loads:
            self._io.submit(self._run_loads, loads)
        return statuses

    def _record(self, rs: RequestState, items: Sequence[Item], statuses: list[ItemStatus]) -> None:
        """End a lookup (lock held): note the items, each miss's reason, and whether rs waits
        (its Event is clear while it does; only requests that ever wait get an Event)."""
        for item, status in zip(items, statuses, strict=True):
            reason = status.reason
            if reason is not None:
                rs.fallbacks[item.key] = reason
                self._counts["miss:" + reason.value] += 1
        rs.items.extend(items)
        if rs.pending():
            if rs.done is None:
                rs.done = self._new_event()
            rs.done.clear()
        elif rs.done is not None:
            rs.done.set()

    def _start(
        self, rs: RequestState, item: Item, in_store: bool, reserve: bool, loads: list[Entry]
    ) -> ItemStatus:
        """Second pass for a miss: join what others started meanwhile, else load or reserve."""
        if item.key in self._entries:
            return self._lookup(rs, item)
        if not (in_store or reserve):
            return MISSES[Reason.NOT_FOUND]
        entry, reason = self._begin_load(rs, item, from_store=in_store)
        if entry is None:
            assert reason is not None, "a failed BeginLoad names its reason"
            return MISSES[reason]
        if in_store:
            loads.append(entry)
            return LOADING_STATUS
        return RESERVED_STATUS

    def _insert(
        self, rs: RequestState, keys: Sequence[str], tensors: Sequence[torch.Tensor], publish: bool
    ) -> list[bool]:
        if isinstance(keys, str) or len(keys) != len(tensors):
            raise InvalidArgumentError("insert takes a list of keys and a list of as many tensors")
        items = [Item.of(check_key(k), t) for k, t in zip(keys, tensors, strict=True)]
        with self._lock:
            self._check_request(rs)
            for item in items:
                if item.key in rs.reserved:
                    expected = self._entries[item.key].item
                    if (expected.shape, expected.dtype) != (item.shape, item.dtype):
                        raise InvalidArgumentError(
                            f"tensor for {item.key!r} has shape {item.shape} and dtype "
                            f"{item.dtype}, but it was reserved as "
                            f"{expected.shape} {expected.dtype}"
                        )
            filling: list[tuple[int, Entry]] = []
            planned: set[str] = set()
            for i, item in enumerate(items):
                if item.key in planned:
                    continue  # a duplicate key is inserted once
                if item.key in rs.reserved:
                    filling.append((i, self._entries[item.key]))
                elif item.key not in self._entries:
                    entry, _ = self._begin_load(rs, item, from_store=False)
                    if entry is not None:
                        filling.append((i, entry))
                if filling and filling[-1][0] == i:
                    planned.add(item.key)
        outcomes, error = self._copy_in([(e, tensors[i]) for i, e in filling])
        results = [False] * len(items)
        with self._lock:
            notify: Notify = []
            for (i, entry), outcome in zip(filling, outcomes, strict=True):
                notify += self._end_load(entry, outcome, Reason.LOAD_FAILED)
                results[i] = entry.state is READY
            self._counts["inserts"] += sum(results)
        self._signal(notify)
        if error is not None:
            raise error
        if publish:
            self._start_publishes(rs, [items[i].key for i, _ in filling if results[i]])
        return results

    def _copy_in(
        self, filling: list[tuple[Entry, torch.Tensor]]
    ) -> tuple[list[TransferOutcome], BaseException | None]:
        """Copy fresh outputs into their LOADING ranges; a failure fails it and all after it."""
        assert_unlocked("payload copy")
        outcomes = [TransferOutcome.FAILED] * len(filling)
        with torch.no_grad():
            for i, (entry, tensor) in enumerate(filling):
                try:
                    self._view(entry.offset, entry.item).copy_(tensor)
                except BaseException as exc:
                    return outcomes, exc
                outcomes[i] = TransferOutcome.OK
        return outcomes, None

    def _start_publishes(self, rs: RequestState, keys: list[str]) -> None:
        with self._lock:
            started = [e for k in keys if (e := self._publish(rs, k)) is not None]
        if started:
            self._io.submit(self._run_publishes, rs.request_id, started)

    def _embeddings(self, rs: RequestState) -> list[torch.Tensor | None]:
        with self._lock:
            self._check_request(rs)
            ranges = [
                (self._entries[it.key].offset, it) if self._serves(rs, it) else None
                for it in rs.items
            ]
        return [None if r is None else self._view(*r) for r in ranges]

    def _fallback(self, rs: RequestState) -> tuple[list[int], list[Reason | None]]:
        with self._lock:
            self._check_request(rs)
            served = [self._serves(rs, it) for it in rs.items]
            reasons = [None if ok else self._fallback_reason(rs, it) for it, ok in
                       zip(rs.items, served, strict=True)]
        return [0 if ok else 1 for ok in served], reasons

    def _serves(self, rs: RequestState, item: Item) -> bool:
        """Whether ``rs`` holds ``item``'s entry with the item's own shape and dtype."""
        if item.key not in rs.holds:
            return False
        held = self._entries[item.key].item
        return held.shape == item.shape and held.dtype == item.dtype

    @staticmethod
    def _fallback_reason(rs: RequestState, item: Item) -> Reason | None:
        if item.key in rs.holds:
            return Reason.MISMATCH
        if item.key in rs.reserved:
            return Reason.NOT_FOUND  # reserved for this request: a miss it must encode
        if item.key in rs.waits:
            return Reason.TIMEOUT
        return rs.fallbacks.get(item.key)

    def _wait(self, rs: RequestState, timeout: float | None) -> bool:
        assert_unlocked("request wait")
        done = rs.done  # None: this request never waited on a load, so nothing is pending
        return done is None or bool(done.wait(timeout))

    async def _wait_async(self, rs: RequestState, timeout: float | None) -> bool:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        with self._lock:
            if not rs.pending():
                return True
            rs.async_waiters.append((loop, future))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            with self._lock:
                if (loop, future) in rs.async_waiters:
                    rs.async_waiters.remove((loop, future))
            return False

    def _close(self, rs: RequestState) -> None:
        with self._lock:
            if self._requests.get(rs.request_id) is not rs:
                return
            notify: Notify = []
            for key in sorted(rs.reserved):
                notify += self._end_load(
                    self._entries[key], TransferOutcome.FAILED, Reason.ABANDONED
                )
            for key in sorted(rs.waits):
                self._release(rs, key)
            for key in sorted(rs.holds):
                self._release(rs, key)
            self._close_request(rs)
            if rs.done is not None or rs.async_waiters:  # someone may wait on rs itself
                notify.append(rs)
        if notify:
            self._signal(notify)

    # ------------------------------------------------------------------ I/O workers
    def _run_loads(self, entries: list[Entry]) -> None:
        """Worker: read every entry from the store, then end each load. Never raises."""
        keys = [e.key for e in entries]
        sizes = [e.item.nbytes for e in entries]
        assert_unlocked("store get_into")
        try:
            codes = self._store.get_into(keys, [e.offset for e in entries], sizes)
            outcomes = [get_outcome(self._store, c, n) for c, n in zip(codes, sizes, strict=True)]
        except Exception:
            outcomes = [TransferOutcome.UNKNOWN] * len(entries)
        with self._lock:
            notify = [
                r
                for e, o in zip(entries, outcomes, strict=True)
                for r in self._end_load(e, o, None)
            ]
        self._signal(notify)

    def _run_publishes(self, request_id: str, entries: list[Entry]) -> None:
        """Worker: write every entry to the store, then end each publish. Never raises."""
        assert_unlocked("store put_from")
        try:
            codes = self._store.put_from(
                [e.key for e in entries],
                [e.offset for e in entries],
                [e.item.nbytes for e in entries],
            )
            outcomes = [put_outcome(self._store, c) for c in codes]
            if len(outcomes) != len(entries):
                outcomes = [TransferOutcome.UNKNOWN] * len(entries)
        except Exception:
            outcomes = [TransferOutcome.UNKNOWN] * len(entries)
        with self._lock:
            for e, o in zip(entries, outcomes, strict=True):
                self._end_publish(request_id, e, o)

    def _signal(self, requests: Notify) -> None:
        """Wake requests with nothing pending. Called with no lock held."""
        assert_unlocked("waking requests")
        wake: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = []
        with self._lock:
            for rs in requests:
                if not rs.pending():
                    if rs.done is not None:
                        rs.done.set()
                    wake += rs.async_waiters
                    rs.async_waiters = []
        for loop, future in wake:
            with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
                loop.call_soon_threadsafe(_resolve, future)

    # ------------------------------------------------------------------ actions (lock held)
    def _open_request(self, request_id: str) -> RequestState:
        rs = RequestState(request_id)
        self._requests[request_id] = rs
        if self._trace is not None:
            self._emit("OpenRequest", request_id)
        return rs

    def _close_request(self, rs: RequestState) -> None:
        assert not (rs.holds or rs.waits or rs.reserved), "close releases everything first"
        del self._requests[rs.request_id]
        if self._trace is not None:
            self._emit("CloseRequest", rs.request_id)

    def _lookup(self, rs: RequestState, item: Item) -> ItemStatus:
        """Lookup(r, k): pin a READY entry, join a LOADING one, else a miss."""
        r, entry = rs.request_id, self._entries.get(item.key)
        if entry is None:
            status = MISSES[Reason.NOT_FOUND]
        elif entry.item.shape != item.shape or entry.item.dtype != item.dtype:
            status = MISSES[Reason.MISMATCH]
        elif entry.doomed or entry.state not in (READY, LOADING):
            status = MISSES[Reason.BUSY]
        elif entry.state is READY:
            transition(entry.state, Step.LOOKUP_HIT)
            if r not in entry.holders:
                self._add_holder(entry, r)
                rs.holds.add(item.key)
            self._counts["hits"] += 1
            status = HIT
        else:
            transition(entry.state, Step.LOOKUP_JOIN)
            if r not in entry.waiters:
                entry.waiters |= {r}
                rs.waits.add(item.key)
                self._counts["joins"] += 1
            status = RESERVED_STATUS if entry.filler == r else LOADING_STATUS
        if self._trace is not None:  # (the per-item actions skip building the event's fields)
            reason = None if status.reason is None else status.reason.value
            self._emit("Lookup", r, item.key, entry, outcome=status.status.name, reason=reason)
        return status

    def _begin_load(
        self, rs: RequestState, item: Item, *, from_store: bool
    ) -> tuple[Entry | None, Reason | None]:
        """BeginLoad(r, k, n): allocate (evicting if the rule allows), LOADING, waiters = {r}."""
        existing = self._entries.get(item.key)
        transition(ABSENT if existing is None else existing.state, Step.BEGIN_LOAD)
        if item.nbytes > self.capacity:
            return self._alloc_failed(rs, item, Reason.TOO_LARGE)
        size = self._allocator.rounded(item.nbytes)
        offset = self._allocate(size)
        if offset is None:
            return self._alloc_failed(rs, item, Reason.NO_SPACE)
        entry = Entry(item, offset, size, from_store, waiters=frozenset({rs.request_id}))
        entry.filler = None if from_store else rs.request_id
        self._entries[item.key] = entry
        self._by_offset[offset] = entry
        rs.waits.add(item.key)
        if not from_store:
            rs.reserved.add(item.key)
        self._counts["loads_started" if from_store else "reservations"] += 1
        self._emit("BeginLoad", rs.request_id, item.key, entry, outcome="OK")
        return entry, None

    def _alloc_failed(self, rs: RequestState, item: Item, reason: Reason) -> tuple[None, Reason]:
        self._counts["alloc_fail:" + reason.value] += 1
        self._emit(
            "BeginLoad", rs.request_id, item.key, None, outcome=reason.name, size=item.nbytes
        )
        return None, reason

    def _allocate(self, size: int) -> int | None:
        offset = self._allocator.allocate(size)
        if offset is not None or not self._enable_eviction:
            return offset
        if self._allocator.free_bytes + self._evictable_bytes < size:
            return None
        lru = (Block(e.offset, e.size, False) for e in self._lru.values())
        window = choose_victims(
            size, lru, self._max_batch, self._allocator.block_before, self._allocator.block_at
        )
        if window is None:
            return None
        for victim in window.victims:
            self._evict(self._by_offset[victim])
        offset = self._allocator.allocate(size)
        if offset != window.offset:
            raise InvariantError(f"eviction freed {window} but the allocator returned {offset}")
        return offset

    def _end_load(
        self, entry: Entry, outcome: TransferOutcome, failed_reason: Reason | None
    ) -> Notify:
        """EndLoad(k, outcome): READY with waiters pinned, or freed, or QUARANTINED."""
        if self._entries.get(entry.key) is not entry:
            raise InvariantError(f"EndLoad for {entry.key!r}, whose entry is gone")
        if outcome is TransferOutcome.OK and not entry.doomed:
            step = Step.END_LOAD_OK
        elif outcome is TransferOutcome.UNKNOWN:
            step = Step.END_LOAD_UNKNOWN
        else:
            step = Step.END_LOAD_DOOMED if entry.doomed else Step.END_LOAD_FAILED
        new_state = transition(entry.state, step)
        waiters = [self._requests[r] for r in sorted(entry.waiters)]
        if entry.filler is not None:
            self._requests[entry.filler].reserved.discard(entry.key)
            entry.filler = None
        if entry.from_store:
            self._counts["loads_" + outcome.name.lower()] += 1
        entry.state = new_state
        for rs in waiters:
            rs.waits.discard(entry.key)
        entry.waiters = NOBODY
        if step is Step.END_LOAD_OK:
            for rs in waiters:
                self._add_holder(entry, rs.request_id)
                rs.holds.add(entry.key)
            if not entry.holders:
                self._make_evictable(entry)
        else:
            reason = {
                Step.END_LOAD_DOOMED: Reason.REMOVED,
                Step.END_LOAD_UNKNOWN: Reason.LOAD_UNKNOWN,
            }.get(step, failed_reason or Reason.LOAD_FAILED)
            for rs in waiters:
                rs.fallbacks[entry.key] = reason
                self._counts["fallback:" + reason.value] += 1
            entry.doomed = False
            if new_state is ABSENT:
                self._free(entry)
        self._emit("EndLoad", None, entry.key, entry, outcome=outcome.name)
        return waiters

    def _release(self, rs: RequestState, key: str) -> None:
        """Release(r, k): drop r's wait or pin; the last pin frees, quarantines or idles it."""
        entry = self._entries[key]
        if key in rs.waits:
            transition(entry.state, Step.RELEASE_WAIT)
            entry.waiters = (entry.waiters - {rs.request_id}) or NOBODY
            rs.waits.discard(key)
        else:
            rs.holds.remove(key)
            self._drop_pin(entry, rs.request_id, Step.RELEASE_PIN)
        if self._trace is not None:
            self._emit("Release", rs.request_id, key, entry)

    def _drop_pin(self, entry: Entry, holder: Holder, plain: Step) -> None:
        if len(entry.holders) == 1:
            if entry.tainted:
                plain = Step.RELEASE_LAST_TAINTED
            elif entry.doomed:
                plain = Step.RELEASE_LAST_DOOMED
        entry.state = transition(entry.state, plain)
        entry.holders = (entry.holders - {holder}) or NOBODY
        if entry.holders:
            return
        if plain is Step.RELEASE_LAST_DOOMED:
            self._free(entry)
        elif plain is Step.RELEASE_LAST_TAINTED:
            entry.tainted = entry.doomed = False
        else:
            self._make_evictable(entry)

    def _evict(self, entry: Entry) -> None:
        """Evict(k): free an idle READY entry chosen by the eviction rule."""
        if entry.pins or entry.doomed or entry.key not in self._lru:
            raise InvariantError(f"eviction of {entry.key!r}, which is not evictable")
        entry.state = transition(entry.state, Step.EVICT)
        self._free(entry)
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += entry.size
        self._emit("Evict", None, entry.key, entry)

    def _remove(self, key: str) -> bool:
        """Remove(k): free now if idle, else doom; QUARANTINED entries wait for a fence."""
        entry = self._entries.get(key)
        if entry is None or entry.doomed or entry.state is QUARANTINED:
            return False
        if entry.state is READY and not entry.pins:
            entry.state = transition(entry.state, Step.REMOVE_IDLE)
            self._free(entry)
        else:
            transition(entry.state, Step.REMOVE_BUSY)
            entry.doomed = True
        self._emit("Remove", None, key, entry)
        return True

    def _publish(self, rs: RequestState, key: str) -> Entry | None:
        """Publish(r, k): a write of k's range to the store starts under its own pin."""
        entry = self._entries.get(key)
        if entry is None or key not in rs.holds or entry.publishing or entry.state is not READY:
            return None
        transition(entry.state, Step.PUBLISH)
        entry.publishing = True
        self._add_holder(entry, ("publish", rs.request_id))
        self._counts["publishes_started"] += 1
        self._emit("Publish", rs.request_id, key, entry)
        return entry

    def _end_publish(self, request_id: str, entry: Entry, outcome: TransferOutcome) -> None:
        """EndPublish(r, k, outcome): drop the publish pin; UNKNOWN taints the entry."""
        entry.publishing = False
        if outcome is TransferOutcome.UNKNOWN:
            entry.tainted = True
        self._counts["publishes_" + outcome.name.lower()] += 1
        self._drop_pin(entry, ("publish", request_id), Step.END_PUBLISH)
        self._emit("EndPublish", request_id, entry.key, entry, outcome=outcome.name)

    def _fence(self, quarantined: list[Entry]) -> int:
        """Fence(): free the ranges that were QUARANTINED before the store was fenced."""
        freed = []
        for entry in quarantined:
            if self._entries.get(entry.key) is entry:
                entry.state = transition(entry.state, Step.FENCE)
                self._free(entry)
                freed.append(entry.key)
        self._counts["fences"] += 1
        self._emit("Fence", None, None, None, keys=freed)
        return len(freed)

    # ------------------------------------------------------------------ helpers (lock held)
    def _add_holder(self, entry: Entry, holder: Holder) -> None:
        if entry.holders:
            entry.holders |= {holder}
            return
        entry.holders = frozenset((holder,))
        entry.pinned_since = time.monotonic()
        if self._lru.pop(entry.key, None) is not None:
            self._evictable_bytes -= entry.size

    def _make_evictable(self, entry: Entry) -> None:
        self._lru[entry.key] = entry
        self._evictable_bytes += entry.size

    def _free(self, entry: Entry) -> None:
        self._allocator.free(entry.offset)
        del self._entries[entry.key]
        del self._by_offset[entry.offset]
        if self._lru.pop(entry.key, None) is not None:
            self._evictable_bytes -= entry.size
        entry.state = ABSENT

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed: create a new EmbeddingCache")

    def _check_request(self, rs: RequestState) -> None:
        if self._closed or self._requests.get(rs.request_id) is not rs:
            self._check_open()
            raise ClosedError(f"request {rs.request_id!r} is closed")

    def _view(self, offset: int, item: Item) -> torch.Tensor:
        """``item``'s bytes at ``offset`` as a tensor of its shape and dtype (zero-copy)."""
        typed = self._typed_pools.get(item.dtype)
        if typed is None:  # one view of the whole pool per dtype; a race makes two, both valid
            typed = self._typed_pools.setdefault(item.dtype, self._pool.view(item.dtype))
        return typed.as_strided(item.shape, _strides(item.shape), offset // item.dtype.itemsize)

    def _emit(
        self,
        action: str,
        request: str | None,
        key: str | None = None,
        entry: Entry | None = None,
        outcome: str | None = None,
        **extra: Any,
    ) -> None:
        if self._trace is None:
            return
        self._seq += 1
        event: dict[str, Any] = {
            "seq": self._seq,
            "action": action,
            "request": request,
            "key": key,
            "outcome": outcome,
        }
        if entry is not None:
            event.update(
                size=entry.size,
                offset=entry.offset,
                state=entry.state.name,
                holders=sorted(
                    h if isinstance(h, str) else "publish:" + h[1] for h in entry.holders
                ),
                waiters=sorted(entry.waiters),
                doomed=entry.doomed,
                tainted=entry.tainted,
            )
        event.update(extra)
        self._trace.append(event)

    def _check_invariants_locked(self) -> None:
        def fail(what: str) -> None:
            raise InvariantError(f"cache invariant broken: {what}")

        self._allocator.check_invariants()
        spans = sorted((e.offset, e.size) for e in self._entries.values())
        if self._allocator.allocations() != spans:  # NoOverlap, Accounting
            fail(f"allocations {self._allocator.allocations()} != entry ranges {spans}")
        if self._allocator.allocated_bytes != sum(s for _, s in spans):
            fail("allocated bytes differ from the sum of entry sizes")
        if {e.offset: e for e in self._entries.values()} != self._by_offset:
            fail("offset index disagrees with the entries")
        holders: dict[str, set[Holder]] = {k: set() for k in self._entries}
        waiters: dict[str, set[str]] = {k: set() for k in self._entries}
        for r, rs in self._requests.items():
            if not rs.reserved <= rs.waits or rs.holds & rs.waits:
                fail(f"request {r!r} bookkeeping inconsistent")
            for key in rs.holds:
                holders.setdefault(key, set()).add(r)
            for key in rs.waits:
                waiters.setdefault(key, set()).add(r)
        for key, entry in self._entries.items():
            publish_pins = {h for h in entry.holders if not isinstance(h, str)}
            if entry.holders - publish_pins != holders.get(key, set()):  # PinsExact
                fail(f"{key!r} holders {entry.holders} != requests holding it {holders.get(key)}")
            if len(publish_pins) != int(entry.publishing):
                fail(f"{key!r} publish pins {publish_pins} but publishing={entry.publishing}")
            if entry.waiters != waiters.get(key, set()):
                fail(f"{key!r} waiters {entry.waiters} != requests waiting {waiters.get(key)}")
            if entry.state is LOADING and entry.holders:
                fail(f"LOADING {key!r} has pin holders")
            if entry.state is not LOADING and (entry.waiters or entry.filler):
                fail(f"{entry.state.name} {key!r} has waiters or a filler")
            if entry.state is QUARANTINED and (entry.holders or entry.doomed):
                fail(f"QUARANTINED {key!r} is pinned or doomed")
            if entry.publishing and (entry.state is not READY or not entry.pins):
                fail(f"{key!r} is published from while not READY and pinned")  # NoUseAfterFree
            if entry.doomed and not (entry.state is LOADING or entry.pins):  # DoomedIsBusy
                fail(f"doomed {key!r} is idle")
            if entry.tainted and not entry.pins:
                fail(f"tainted {key!r} is not pinned (it should be QUARANTINED)")
        evictable = {
            k
            for k, e in self._entries.items()
            if e.state is READY and not e.pins and not e.doomed and not e.tainted
        }
        if set(self._lru) != evictable:  # EvictableExact
            fail(f"LRU {list(self._lru)} != evictable {sorted(evictable)}")
        if self._evictable_bytes != sum(e.size for e in self._lru.values()):
            fail("evictable byte count drifted")

    def __repr__(self) -> str:
        return f"EmbeddingCache(capacity={self.capacity}, entries={len(self._entries)})"


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


def _by_prefix(counts: Counter[str], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: v for k, v in counts.items() if k.startswith(prefix)}
