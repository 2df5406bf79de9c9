"""``CacheCore``: the request protocol over the DESIGN actions (``embcache.core.actions``).

Theory of operation (after h11's ``Connection``, which holds its state machine and exposes only
what a caller may do). ``CacheCore`` holds the ``Actions`` privately and offers a driver only
*request steps* and *read-only queries* (``CoreQueries``: ``entries``, ``stats``...). A step
runs DESIGN actions underneath (so the trace and the spec correspondence are the actions') and
returns ONE ``Effects`` record (``embcache.core.effects``): its result, the loads and writes to
start, the requests to wake, the ranges freed, the trace events. The driver takes its lock,
calls one step, carries out the record, and does no I/O until the lock is released
(``EmbeddingCache._run``). A step checks first and raises changing nothing: ``ClosedError`` for
a closed request, or a closed cache (steps that start something; the ends of transfers in
flight always run). Two-part steps: ``begin_lookup`` then, when it names keys to ask the
store about, ``finish_lookup`` (loads to start, each ended by ``end_loads``); ``begin_insert`` /
``finish_insert`` (and request-less ``..._insert_batch``); ``begin_fills`` / ``end_fills`` (an
outside writer fills the ranges; one still handed out when its request ends ends UNKNOWN);
``publish`` / ``end_publishes``; ``begin_fence`` / ``fence`` (or ``abandon_fence``).

Every hit and every release runs the one body of its action (``Actions.lookup_all``,
``Actions.release_all``), traced or not: the path production runs is the path the model, the
stateful tests and trace validation check.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple, TypeVar

from embcache.core.actions import Actions
from embcache.core.effects import Effects, Fill, LookupStart, writes_of
from embcache.core.entries import Entry, FenceSnapshot, ItemLike, RequestState, matches
from embcache.core.lifecycle import READY
from embcache.core.outcomes import (
    LOADING_STATUS,
    MISSES,
    RESERVED_STATUS,
    ItemStatus,
    Reason,
    TransferOutcome,
)
from embcache.core.policy import Policy
from embcache.core.queries import CoreQueries
from embcache.errors import ClosedError, InvalidArgumentError, InvariantError, RequestError

NOT_FOUND = Reason.NOT_FOUND
T = TypeVar("T")
Ranges = list[tuple[int, ItemLike] | None]


class _Again(NamedTuple):
    """The item of an entry looked up again to republish it (``CacheCore.republish``)."""

    key: str
    shape: tuple[int, ...]
    dtype: Hashable
    nbytes: int


class CacheCore(CoreQueries[Actions]):
    """The cache's state machine: request steps and read-only queries. Not thread-safe."""

    def __init__(
        self, capacity: int, alignment: int, max_eviction_batch: int, enable_eviction: bool, *,
        trace: bool = False, clock: Callable[[], float] = float, policy: Policy | None = None,
        record_freed: bool = False,
    ) -> None:  # fmt: skip
        self._actions = Actions(
            capacity, alignment, max_eviction_batch, enable_eviction,
            trace=trace, clock=clock, policy=policy, record_freed=record_freed,
        )  # fmt: skip
        actions = self._actions  # the state the steps read: the actions' own objects, not rebound
        self._entries = actions._entries
        self._requests = actions._requests
        self._counts = actions._counts
        self._record = actions._record
        self._buffered = trace or record_freed  # whether a step has events or ranges to hand
        self._batches = 0  # request-less inserts so far (their internal requests' ids)
        self._closed = False

    # ------------------------------------------------------------------ request steps
    def start(self) -> Effects[None]:
        """The first step: hands the driver the Init event (when tracing)."""
        return self._done(Effects(None))

    def open_request(self, request_id: str) -> Effects[RequestState]:
        """OpenRequest(r). Raises ``ClosedError`` (cache closed) or ``RequestError`` (the id is
        taken), changing nothing."""
        if self._closed or request_id in self._requests:
            self._check_new(request_id)
        fx = Effects(self._actions.open_request(request_id))
        return self._taken(fx) if self._buffered else fx

    def open_lookup(
        self, request_id: str, items: Sequence[ItemLike]
    ) -> Effects[tuple[RequestState, list[int | None] | None]]:
        """``open_request``, a lookup with no store asked and nothing reserved, then the offsets
        of the ranges it holds (None while it waits on a load), in one step."""
        self._check_new(request_id)
        rs = self._actions.open_request(request_id)
        fx = Effects((rs, self._lookup_ended(rs, items)))
        fx.waiting = rs
        return self._taken(fx) if self._buffered else fx

    def begin_lookup(
        self, rs: RequestState, items: Sequence[ItemLike], ask_store: bool, reserve: bool
    ) -> Effects[LookupStart]:
        """Lookup every item (a miss larger than the pool is TOO_LARGE). When misses remain
        and the store is to be asked, the result names their keys: call ``finish_lookup``
        next; else the lookup is over (misses reserved when ``reserve``). O(len(items))."""
        if self._closed or self._requests.get(rs.request_id) is not rs:
            self._check(rs)
        record = self._record
        if record is not None:
            for item in items:
                record(item.key)
        statuses, missed = self._actions.lookup_all(rs, items)
        ask: list[str] = []
        if missed:
            rs.served = None
            statuses, ask = self._misses(rs, items, statuses, ask_store, reserve)
        else:  # all hits: nothing to note for fallback; a first lookup notes what it serves
            entries = self._entries
            rs.served = None if rs.items else [(entries[it.key].offset, it) for it in items]
            rs.items.extend(items)
        fx = Effects(LookupStart(statuses, ask))
        if not ask:
            fx.waiting = rs
        return self._taken(fx) if self._buffered else fx

    def finish_lookup(
        self, rs: RequestState, found: Mapping[str, bool] | None
    ) -> Effects[list[ItemStatus]]:
        """The second pass of a lookup after the store said which asked keys it holds
        (``found``; None: the store failed): join what others started meanwhile, else start
        a store read or a reservation. The final statuses; the loads to start."""
        self._check(rs)
        pending = rs.lookup_pending
        if pending is None:
            raise InvariantError(f"finish_lookup for {rs.request_id!r} without begin_lookup")
        rs.lookup_pending = None
        items, statuses, reserve = pending
        loads: list[Entry] = []
        statuses = self._start_misses(
            rs, items, statuses, found or {}, reserve, found is None, loads
        )
        return self._done(Effects(statuses, loads, waiting=rs))

    def offsets_when_ready(self, rs: RequestState) -> Effects[list[int | None] | None]:
        """The offsets of the ranges ``rs`` holds (``served``), None while it waits on a load."""
        self._check(rs)
        return self._done(Effects(None if rs.pending() else self._offsets(rs)))

    def lookup_offsets(
        self, rs: RequestState, items: Sequence[ItemLike]
    ) -> Effects[list[int | None] | None]:
        """A lookup with no store asked and nothing reserved, then ``offsets_when_ready``."""
        if self._closed or self._requests.get(rs.request_id) is not rs:
            self._check(rs)
        fx = Effects(self._lookup_ended(rs, items))
        fx.waiting = rs
        return self._taken(fx) if self._buffered else fx

    def begin_insert(self, rs: RequestState, items: Sequence[ItemLike]) -> Effects[list[Fill]]:
        """The LOADING entries ``rs`` must now fill, each with its item's index: its
        reservations, and a BeginLoad for each absent key (a duplicate key once). Raises
        (changing nothing) when a reserved key's shape or dtype differs from the reservation."""
        if self._closed or self._requests.get(rs.request_id) is not rs:
            self._check(rs)
        fx = Effects(self._plan_fills(rs, items))
        return self._taken(fx) if self._buffered else fx

    def finish_insert(
        self, rs: RequestState, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome],
        count: int, publish: bool,
    ) -> Effects[list[bool]]:  # fmt: skip
        """EndLoad each filled entry with its copy's outcome (whatever became of the cache or
        the request meanwhile: a load in flight must end); which of ``count`` items are cached
        now, the requests to wake, and (when ``publish``) the writes of the cached ones."""
        results, wake = self._end_fills(fills, outcomes, count)
        writes = None
        if publish:
            writes = writes_of(rs, self._publish(rs, [e.key for i, e in fills if results[i]]))
        fx = Effects(results)
        fx.writes, fx.wake = writes, wake
        return self._taken(fx) if self._buffered else fx

    def begin_fills(self, rs: RequestState, items: Sequence[ItemLike]) -> Effects[list[Fill]]:
        """``begin_insert`` whose ranges are handed out to a writer outside the driver: each
        is noted in ``rs.filling`` until ``end_fills`` (or ``end_request``) ends it."""
        self._check(rs)
        fills = self._plan_fills(rs, items)
        rs.filling.update(entry.key for _, entry in fills)
        return self._done(Effects(fills))

    def end_fills(
        self,
        rs: RequestState,
        keys: Sequence[str],
        outcomes: Sequence[TransferOutcome],
        publish: bool,
    ) -> Effects[list[bool]]:
        """EndLoad each range ``rs`` handed out for ``keys`` with the writer's outcome (a key
        not handed out is left alone: False); which are cached now, the requests to wake, and
        (when ``publish``) the writes of the cached ones."""
        self._check(rs)
        results = [False] * len(keys)
        wake: list[RequestState] = []
        end_load = self._actions.end_load
        for i, (key, outcome) in enumerate(zip(keys, outcomes, strict=True)):
            if key in rs.filling:
                rs.filling.discard(key)
                entry = self._entries[key]
                wake += end_load(entry, outcome, Reason.LOAD_FAILED)
                results[i] = entry.state is READY
        self._counts["inserts"] += sum(results)
        writes = None
        if publish:
            cached = [k for k, ok in zip(keys, results, strict=True) if ok]
            writes = writes_of(rs, self._publish(rs, cached))
        return self._done(Effects(results, writes=writes, wake=wake))

    def begin_insert_batch(
        self, items: Sequence[ItemLike]
    ) -> Effects[tuple[RequestState, list[Fill]]]:
        """A request-less insert: ``begin_insert`` for an internal request opened here (id
        ``insert#N``), which ``finish_insert_batch`` ends."""
        self._check_open()
        self._batches += 1
        request_id = f"insert#{self._batches}"
        while request_id in self._requests:  # a caller's own request took the name
            self._batches += 1
            request_id = f"insert#{self._batches}"
        rs = self._actions.open_request(request_id)
        return self._done(Effects((rs, self._plan_fills(rs, items))))

    def finish_insert_batch(
        self, rs: RequestState, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome],
        count: int, publish: bool,
    ) -> Effects[list[bool]]:  # fmt: skip
        """``finish_insert``, then ``end_request``: the inserted entries end idle (a publish
        holds its own pin). The results, the requests to wake, the writes to start."""
        results, wake = self._end_fills(fills, outcomes, count)
        writes = None
        if publish:
            writes = writes_of(rs, self._publish(rs, [e.key for i, e in fills if results[i]]))
        wake += self._end(rs)
        return self._done(Effects(results, writes=writes, wake=wake))

    def end_loads(
        self, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]
    ) -> Effects[None]:
        """EndLoad each store read with its outcome; the requests to wake."""
        wake: list[RequestState] = []
        end_load = self._actions.end_load
        for entry, outcome in zip(entries, outcomes, strict=True):
            wake += end_load(entry, outcome, None)
        return self._done(Effects(None, wake=wake))

    def publish(self, rs: RequestState, keys: Sequence[str], store: bool) -> Effects[list[bool]]:
        """Publish each key ``rs`` holds READY (with a ``store`` only); per key whether a write
        started; the writes to start."""
        self._check(rs)
        started = self._publish(rs, keys) if store else [None] * len(keys)
        return self._done(Effects([e is not None for e in started], writes=writes_of(rs, started)))

    def end_publishes(
        self, request_id: str, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]
    ) -> Effects[None]:
        """EndPublish each write with its outcome."""
        end_publish = self._actions.end_publish
        for entry, outcome in zip(entries, outcomes, strict=True):
            end_publish(request_id, entry, outcome)
        return self._done(Effects(None))

    def republish(self, entries: Sequence[Entry]) -> Effects[list[bool]]:
        """Publish again each entry whose publish ended FAILED (``embcache.driver.backlog``)
        if it is still its key's entry, READY, and not doomed, tainted or being published: an
        internal request ``republish#N`` pins it (Lookup), publishes it (Publish) and closes
        (the publish holds its own pin), the very actions of a request's publish. An entry
        evicted, removed or quarantined since is skipped. Per entry whether a write started."""
        self._check_open()
        self._batches += 1
        request_id = f"republish#{self._batches}"
        while request_id in self._requests:  # a caller's own request took the name
            self._batches += 1
            request_id = f"republish#{self._batches}"
        rs = self._actions.open_request(request_id)
        present = self._entries
        live = [
            e for e in entries
            if present.get(e.key) is e and e.state is READY
            and not (e.doomed or e.tainted or e.publishing)
        ]  # fmt: skip
        if live:
            again = [_Again(e.key, e.shape, e.dtype, e.size) for e in live]
            _, missed = self._actions.lookup_all(rs, again)
            assert not missed, "a live READY entry is a hit"
            self._counts["hits"] -= len(live)  # a republish's pin is no request's hit
        started = self._publish(rs, [e.key for e in live])
        writes = writes_of(rs, started)
        wake = self._end(rs)
        begun = {e for e in started if e is not None}
        return self._done(Effects([e in begun for e in entries], writes=writes, wake=wake))

    def end_request(self, rs: RequestState) -> Effects[None]:
        """End every reservation of ``rs`` (its waiters fall back; a range still handed out
        to a writer ends UNKNOWN: quarantined), release every wait and pin in lookup order, then
        CloseRequest; the requests to wake. A request already closed: nothing. Idempotent."""
        if self._requests.get(rs.request_id) is not rs:
            return self._done(Effects(None))
        fx = Effects(None)
        fx.wake, fx.closed = self._end(rs), rs
        return self._taken(fx) if self._buffered else fx

    def served(self, rs: RequestState) -> Effects[Ranges]:
        """Per looked-up item, the range it may read (offset and item) or None (what
        ``rs.served`` holds, when set: a driver may read that instead of this step)."""
        if self._closed or self._requests.get(rs.request_id) is not rs:
            self._check(rs)
        fx = Effects(self._served(rs))
        return self._taken(fx) if self._buffered else fx

    def fallback(self, rs: RequestState) -> Effects[tuple[list[int], list[Reason | None]]]:
        """Per looked-up item: 1 where the caller must encode it, and why."""
        self._check(rs)
        served = [r is not None for r in self._served(rs)]
        pairs = zip(rs.items, served, strict=True)
        reasons = [None if ok else rs.fallback_reason(it) for it, ok in pairs]
        return self._done(Effects(([0 if ok else 1 for ok in served], reasons)))

    def remove(self, key: str) -> Effects[bool]:
        """Remove(k): freed now if idle, doomed if busy; False when absent (or already so)."""
        self._check_open()
        return self._done(Effects(self._actions.remove(key)))

    def clear(self) -> Effects[int]:
        """Remove every entry; how many were removed or doomed."""
        self._check_open()
        remove = self._actions.remove
        return self._done(Effects(sum(remove(key) for key in list(self._entries))))

    def begin_fence(self, begun: list[FenceSnapshot]) -> Effects[FenceSnapshot]:
        """BeginFence(f): the snapshot to end with ``fence`` (or ``abandon_fence``), also
        appended to ``begun`` (the driver keeps it even if carrying out the step raises)."""
        self._check_open()
        begun.append(self._actions.begin_fence())
        return self._done(Effects(begun[-1]))

    def fence(self, snap: FenceSnapshot) -> Effects[int]:
        """Fence(f) after the store's fence returned; how many entries it freed."""
        return self._done(Effects(self._actions.fence(snap)))

    def abandon_fence(self, snap: FenceSnapshot) -> Effects[None]:
        """The store's fence failed: the fence ends, freeing nothing."""
        self._actions.abandon_fence(snap)
        return self._done(Effects(None))

    def close(self) -> Effects[bool]:
        """Take no new requests or inserts any more (transfers in flight still end); whether
        it was open."""
        was_open, self._closed = not self._closed, True
        for rs in self._requests.values():  # ``served`` raises from now on: no shortcut to it
            rs.served = None
        return self._done(Effects(was_open))

    # ------------------------------------------------------------------ helpers
    def _done(self, fx: Effects[T]) -> Effects[T]:
        """The step's record, with the events and freed ranges its actions buffered."""
        return self._taken(fx) if self._buffered else fx

    def _taken(self, fx: Effects[T]) -> Effects[T]:
        fx.events, fx.freed = self._actions.take_events(), self._actions.take_freed()
        return fx

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed: create a new EmbeddingCache")

    def _check(self, rs: RequestState) -> None:
        """Raise ``ClosedError`` unless the cache and ``rs`` are open."""
        if self._closed or self._requests.get(rs.request_id) is not rs:
            self._check_open()
            raise ClosedError(f"request {rs.request_id!r} is closed")

    def _check_new(self, request_id: str) -> None:
        self._check_open()
        if request_id in self._requests:
            raise RequestError(f"request {request_id!r} is already open: ids must be unique")

    def _misses(
        self, rs: RequestState, items: Sequence[ItemLike], statuses: list[ItemStatus],
        ask_store: bool, reserve: bool,
    ) -> tuple[list[ItemStatus], list[str]]:  # fmt: skip
        """A lookup's first pass past ``lookup_all`` when some item was not a hit: the
        statuses, and the keys to ask the store about."""
        capacity = self.capacity
        not_found = False
        for i, item in enumerate(items):
            if statuses[i].reason is NOT_FOUND:
                if item.nbytes > capacity:
                    statuses[i] = MISSES[Reason.TOO_LARGE]
                else:
                    not_found = True
        if not (not_found and (ask_store or reserve)):
            self._end_lookup(rs, items, statuses)
            return statuses, []
        if not ask_store:
            return self._start_misses(rs, items, statuses, {}, reserve, False), []
        rs.lookup_pending = (list(items), statuses, reserve)
        pairs = zip(items, statuses, strict=True)
        return statuses, sorted({it.key for it, s in pairs if s.reason is NOT_FOUND})

    def _lookup_ended(self, rs: RequestState, items: Sequence[ItemLike]) -> list[int | None] | None:
        """A lookup asking no store, reserving nothing; the offsets (None while it waits)."""
        record = self._record
        if record is not None:
            for item in items:
                record(item.key)
        statuses, missed = self._actions.lookup_all(rs, items)
        rs.served = None
        if missed:
            self._misses(rs, items, statuses, False, False)
        else:
            rs.items.extend(items)
        return None if rs.pending() else self._offsets(rs)

    def _offsets(self, rs: RequestState) -> list[int | None]:
        return [None if r is None else r[0] for r in self._served(rs)]

    def _served(self, rs: RequestState) -> Ranges:
        holds, entries = rs.holds, self._entries
        out: Ranges = []
        for item in rs.items:
            entry = entries[item.key] if item.key in holds else None
            out.append(None if entry is None or not matches(entry, item) else (entry.offset, item))
        return out

    def _plan_fills(self, rs: RequestState, items: Sequence[ItemLike]) -> list[Fill]:
        entries = self._entries
        for item in items if rs.reserved else ():  # (nothing reserved: nothing to check)
            if item.key in rs.reserved:
                expected = entries[item.key]
                if not matches(expected, item):
                    raise InvalidArgumentError(
                        f"tensor for {item.key!r} has shape {item.shape} and dtype "
                        f"{item.dtype}, but it was reserved as {expected.shape} {expected.dtype}"
                    )
        fills: list[Fill] = []
        planned: set[str] = set()
        begin_load = self._actions.begin_load
        for i, item in enumerate(items):
            key = item.key
            if key in planned:
                continue  # a duplicate key is inserted once
            if key in rs.reserved:
                fills.append(Fill(i, entries[key]))
                planned.add(key)
            elif key not in entries:
                entry, _ = begin_load(rs, item, from_store=False)
                if entry is not None:
                    fills.append(Fill(i, entry))
                    planned.add(key)
        return fills

    def _end_fills(
        self, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome], count: int
    ) -> tuple[list[bool], list[RequestState]]:
        """EndLoad each filled entry with its copy's outcome: which of ``count`` items are
        cached now, and the requests to wake."""
        results = [False] * count
        wake: list[RequestState] = []
        end_load = self._actions.end_load
        for (i, entry), outcome in zip(fills, outcomes, strict=True):
            wake += end_load(entry, outcome, Reason.LOAD_FAILED)
            results[i] = entry.state is READY
        self._counts["inserts"] += sum(results)
        return results, wake

    def _publish(self, rs: RequestState, keys: Sequence[str]) -> list[Entry | None]:
        """Publish(r, k) of each key: per key the entry to write, or None."""
        publish = self._actions.publish
        return [publish(rs, key) for key in keys]

    def _end(self, rs: RequestState) -> list[RequestState]:
        """``end_request``'s work; the requests to wake."""
        actions = self._actions
        rs.lookup_pending = rs.served = None
        wake: list[RequestState] = []
        if rs.reserved:
            for key in sorted(rs.reserved):
                outcome = TransferOutcome.UNKNOWN if key in rs.filling else TransferOutcome.FAILED
                wake += actions.end_load(self._entries[key], outcome, Reason.ABANDONED)
            rs.filling.clear()
        if rs.waits:
            actions.release_all(rs, sorted(rs.waits))
        actions.release_all(rs, rs.release_order())
        actions.close_request(rs)
        return wake

    def _start_misses(
        self, rs: RequestState, items: Sequence[ItemLike], statuses: list[ItemStatus],
        found: Mapping[str, bool], reserve: bool, store_error: bool,
        loads: list[Entry] | None = None,
    ) -> list[ItemStatus]:  # fmt: skip
        """Second pass over the NOT_FOUND items: join what others started meanwhile, else
        BeginLoad a store read (appended to ``loads``) or a reservation; then end the lookup."""
        entries, actions = self._entries, self._actions
        for i, item in enumerate(items):
            if statuses[i].reason is not NOT_FOUND:
                continue
            in_store = found.get(item.key, False)
            if item.key in entries:
                statuses[i] = actions.lookup(rs, item)
            elif in_store or reserve:
                entry, reason = actions.begin_load(rs, item, from_store=in_store)
                if entry is None:
                    assert reason is not None, "a failed BeginLoad names its reason"
                    statuses[i] = MISSES[reason]
                elif in_store:
                    assert loads is not None, "a store read only after the store was asked"
                    loads.append(entry)
                    statuses[i] = LOADING_STATUS
                else:
                    statuses[i] = RESERVED_STATUS
            if statuses[i].reason is NOT_FOUND and store_error:
                statuses[i] = MISSES[Reason.STORE_ERROR]
        self._end_lookup(rs, items, statuses)
        return statuses

    def _end_lookup(
        self, rs: RequestState, items: Sequence[ItemLike], statuses: Sequence[ItemStatus]
    ) -> None:
        """Note the items and each miss's reason (for ``fallback``) and count the misses."""
        counts = self._counts
        for item, status in zip(items, statuses, strict=True):
            reason = status.reason
            if reason is not None:
                rs.fallbacks[item.key] = reason
                counts["miss:" + reason.value] += 1
        rs.items.extend(items)
