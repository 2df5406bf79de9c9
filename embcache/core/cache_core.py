"""``CacheCore``: the DESIGN actions (``embcache.core.actions``) and the request protocol over them.

Theory of operation (after h11, at the level of a request). A driver opens a request
(``open_request``) and then makes one call per step; each runs DESIGN actions underneath (so the
trace and the spec correspondence are the actions'), updates counters, fallbacks and the policy's
record, and returns a small record of what the driver must do next (``embcache.core.effects``):

- ``begin_lookup(rs, items)``: statuses, and the keys to ask the store about (none: done);
  ``finish_lookup(rs, found | None)`` after the store answered (None: it failed): statuses and
  the loads to start; each load ends with ``end_loads``.
- ``begin_insert(rs, items)``: the ranges to fill, each with its item's index;
  ``finish_insert(fills, outcomes, n)``: which items are cached, and the requests to wake.
- ``begin_fills(rs, items)`` / ``end_fills(rs, keys, outcomes)``: an insert whose bytes an
  outside writer (another process) puts into the ranges handed out; a request that ends with
  a range still handed out ends it UNKNOWN (the writer may still land), never FAILED.
- ``begin_publishes(rs, keys)`` / ``end_publishes``; ``served`` / ``fallback`` (what a request may
  read, and what it must encode); ``end_request(rs)``: the requests to wake.

The driver takes the trace events (``take_events``) and freed ranges (``take_freed``) the calls
buffered. Outside code reads the state through read-only views and queries, never edits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from embcache.core.actions import Actions
from embcache.core.allocator import BestFitAllocator
from embcache.core.effects import Fill, InsertEnd, LookupEnd, LookupStart
from embcache.core.entries import NOBODY, Entry, ItemLike, RequestState, matches
from embcache.core.lifecycle import ABSENT, READY, EntryState, Step
from embcache.core.outcomes import (
    HIT,
    LOADING_STATUS,
    MISSES,
    RESERVED_STATUS,
    ItemStatus,
    Reason,
    TransferOutcome,
)
from embcache.errors import InvalidArgumentError, InvariantError

NOT_FOUND = Reason.NOT_FOUND


class CacheCore(Actions):
    """The cache's state machine: DESIGN actions and request steps. Not thread-safe."""

    # ------------------------------------------------------------------ request steps
    def begin_lookup(
        self, rs: RequestState, items: Sequence[ItemLike], *, ask_store: bool, reserve: bool
    ) -> LookupStart:
        """Lookup every item (a miss larger than the pool is TOO_LARGE). When misses remain
        and the store is to be asked, returns their keys: call ``finish_lookup`` next; else
        the lookup is over (misses reserved when ``reserve``). O(len(items)).

        Hits are pinned in one fused loop (``Lookup``'s hit branch, inlined) when no trace is
        taken; every other item goes through the ``lookup`` action."""
        record = self._record
        if record is not None:
            for item in items:
                record(item.key)
        if self._events is None:
            statuses, missed = self._pin_hits(rs, items)
        else:
            statuses, missed = [], False
            for item in items:
                status = self.lookup(rs, item)
                statuses.append(status)
                missed = missed or status is not HIT
        if not missed:  # all hits: nothing to note for fallback
            rs.items.extend(items)
            return LookupStart(statuses, [])
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
            return LookupStart(statuses, [])
        if not ask_store:
            return LookupStart(self._start_misses(rs, items, statuses, {}, reserve, False), [])
        rs.lookup_pending = (list(items), statuses, reserve)
        pairs = zip(items, statuses, strict=True)
        return LookupStart(statuses, sorted({it.key for it, s in pairs if s.reason is NOT_FOUND}))

    def finish_lookup(self, rs: RequestState, found: Mapping[str, bool] | None) -> LookupEnd:
        """The second pass of a lookup after the store said which asked keys it holds
        (``found``; None: the store failed): join what others started meanwhile, else start
        a store read or a reservation. Returns the final statuses and the loads to run."""
        pending = rs.lookup_pending
        if pending is None:
            raise InvariantError(f"finish_lookup for {rs.request_id!r} without begin_lookup")
        rs.lookup_pending = None
        items, statuses, reserve = pending
        loads: list[Entry] = []
        statuses = self._start_misses(
            rs, items, statuses, found or {}, reserve, found is None, loads
        )
        return LookupEnd(statuses, loads)

    def begin_insert(self, rs: RequestState, items: Sequence[ItemLike]) -> list[Fill]:
        """The LOADING entries ``rs`` must now fill, each with its item's index: its
        reservations, and a BeginLoad for each absent key (a duplicate key once). Raises
        (changing nothing) when a reserved key's shape or dtype differs from the reservation."""
        entries = self._entries
        for item in items:
            if item.key in rs.reserved:
                expected = entries[item.key]
                if not matches(expected, item):
                    raise InvalidArgumentError(
                        f"tensor for {item.key!r} has shape {item.shape} and dtype "
                        f"{item.dtype}, but it was reserved as {expected.shape} {expected.dtype}"
                    )
        fills: list[Fill] = []
        planned: set[str] = set()
        for i, item in enumerate(items):
            key = item.key
            if key in planned:
                continue  # a duplicate key is inserted once
            if key in rs.reserved:
                fills.append(Fill(i, entries[key]))
                planned.add(key)
            elif key not in entries:
                entry, _ = self.begin_load(rs, item, from_store=False)
                if entry is not None:
                    fills.append(Fill(i, entry))
                    planned.add(key)
        return fills

    def finish_insert(
        self, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome], count: int
    ) -> InsertEnd:
        """EndLoad each filled entry with its copy's outcome; which of ``count`` items are
        cached now, and the requests to wake."""
        results = [False] * count
        wake: list[RequestState] = []
        for (i, entry), outcome in zip(fills, outcomes, strict=True):
            wake += self.end_load(entry, outcome, Reason.LOAD_FAILED)
            results[i] = entry.state is READY
        self._counts["inserts"] += sum(results)
        return InsertEnd(results, wake)

    def begin_fills(self, rs: RequestState, items: Sequence[ItemLike]) -> list[Fill]:
        """``begin_insert`` whose ranges are handed out to a writer outside the driver: each
        is noted in ``rs.filling`` until ``end_fills`` (or ``end_request``) ends it."""
        fills = self.begin_insert(rs, items)
        rs.filling.update(entry.key for _, entry in fills)
        return fills

    def end_fills(
        self, rs: RequestState, keys: Sequence[str], outcomes: Sequence[TransferOutcome]
    ) -> InsertEnd:
        """EndLoad each range ``rs`` handed out for ``keys`` with the writer's outcome (a key
        not handed out is left alone: False); which are cached now, and the requests to wake."""
        results = [False] * len(keys)
        wake: list[RequestState] = []
        for i, (key, outcome) in enumerate(zip(keys, outcomes, strict=True)):
            if key in rs.filling:
                rs.filling.discard(key)
                entry = self._entries[key]
                wake += self.end_load(entry, outcome, Reason.LOAD_FAILED)
                results[i] = entry.state is READY
        self._counts["inserts"] += sum(results)
        return InsertEnd(results, wake)

    def begin_insert_batch(self, items: Sequence[ItemLike]) -> tuple[RequestState, list[Fill]]:
        """A request-less insert: ``begin_insert`` for an internal request opened here (id
        ``insert#N``), which ``finish_insert_batch`` ends."""
        self._batches += 1
        request_id = f"insert#{self._batches}"
        while request_id in self._requests:  # a caller's own request took the name
            self._batches += 1
            request_id = f"insert#{self._batches}"
        rs = self.open_request(request_id)
        return rs, self.begin_insert(rs, items)

    def finish_insert_batch(
        self,
        rs: RequestState,
        fills: Sequence[Fill],
        outcomes: Sequence[TransferOutcome],
        count: int,
        *,
        publish: bool,
    ) -> tuple[InsertEnd, list[Entry]]:
        """``finish_insert``, then (when ``publish``) a publish of each cached item, then
        ``end_request``: the inserted entries end idle. Returns the insert's end and the
        entries to write to the store (then report through ``end_publishes``)."""
        results, wake = self.finish_insert(fills, outcomes, count)
        writes: list[Entry] = []
        if publish:
            for i, entry in fills:
                if results[i] and (started := self.publish(rs, entry.key)) is not None:
                    writes.append(started)
        return InsertEnd(results, wake + self.end_request(rs)), writes

    def end_loads(
        self, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]
    ) -> list[RequestState]:
        """EndLoad each store read with its outcome; returns the requests to wake."""
        wake: list[RequestState] = []
        for entry, outcome in zip(entries, outcomes, strict=True):
            wake += self.end_load(entry, outcome, None)
        return wake

    def begin_publishes(self, rs: RequestState, keys: Sequence[str]) -> list[Entry | None]:
        """Publish each key ``rs`` holds READY; per key the entry to write, or None."""
        return [self.publish(rs, key) for key in keys]

    def end_publishes(
        self, request_id: str, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]
    ) -> None:
        """EndPublish each write with its outcome."""
        for entry, outcome in zip(entries, outcomes, strict=True):
            self.end_publish(request_id, entry, outcome)

    def end_request(self, rs: RequestState) -> list[RequestState]:
        """End every reservation of ``rs`` (its waiters fall back; a range still handed out
        to a writer ends UNKNOWN: quarantined), release every wait and pin in lookup order, then
        CloseRequest. Returns the requests to wake."""
        rs.lookup_pending = None
        wake: list[RequestState] = []
        for key in sorted(rs.reserved):
            outcome = TransferOutcome.UNKNOWN if key in rs.filling else TransferOutcome.FAILED
            wake += self.end_load(self._entries[key], outcome, Reason.ABANDONED)
        rs.filling.clear()
        for key in sorted(rs.waits):
            self.release(rs, key)
        if self._events is None:
            self._unpin_all(rs)
        else:
            for key in _release_order(rs):
                self.release(rs, key)
        self.close_request(rs)
        return wake

    def served(self, rs: RequestState) -> list[tuple[int, ItemLike] | None]:
        """Per looked-up item, the range it may read (offset and item) or None."""
        holds, entries = rs.holds, self._entries
        out: list[tuple[int, ItemLike] | None] = []
        for item in rs.items:
            entry = entries[item.key] if item.key in holds else None
            out.append(None if entry is None or not matches(entry, item) else (entry.offset, item))
        return out

    def fallback(self, rs: RequestState) -> tuple[list[int], list[Reason | None]]:
        """Per looked-up item: 1 where the caller must encode it, and why."""
        served = [r is not None for r in self.served(rs)]
        pairs = zip(rs.items, served, strict=True)
        reasons = [None if ok else _fallback_reason(rs, it) for it, ok in pairs]
        return [0 if ok else 1 for ok in served], reasons

    @staticmethod
    def pending(rs: RequestState) -> bool:
        """Whether ``rs`` waits on a load that someone else fills."""
        return rs.pending()

    # ------------------------------------------------------------------ effects to take
    def take_events(self) -> list[dict[str, Any]]:
        """The trace events buffered since the last call, in order (none when not tracing)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def take_freed(self) -> list[tuple[int, int]]:
        """The ``(offset, size)`` ranges freed since the last call (with ``record_freed``)."""
        freed = self._freed
        if not freed:
            return []
        self._freed = []
        return freed

    # ------------------------------------------------------------------ read-only views
    @property
    def entries(self) -> Mapping[str, Entry]:
        """Every entry by key (a read-only view; the entries are the core's: do not edit)."""
        return MappingProxyType(self._entries)

    @property
    def requests(self) -> Mapping[str, RequestState]:
        """Every open request by id (a read-only view)."""
        return MappingProxyType(self._requests)

    @property
    def counts(self) -> Mapping[str, int]:
        """The counters (a read-only view)."""
        return MappingProxyType(self._counts)

    @property
    def quarantine(self) -> Mapping[str, float]:
        """QUARANTINED keys and when each was quarantined (a read-only view)."""
        return MappingProxyType(self._quarantine)

    @property
    def pinned_since(self) -> Mapping[str, float]:
        """Pinned keys and when their first pin came (a read-only view)."""
        return MappingProxyType(self._pinned_since)

    @property
    def allocator(self) -> BestFitAllocator:
        """The allocator, for its queries (``allocated_bytes``, ``free_blocks()``...) only."""
        return self._allocator

    @property
    def evictable_bytes(self) -> int:
        """Bytes of the entries in the eviction order."""
        return self._evictable_bytes

    def eviction_order(self) -> list[str]:
        """The evictable keys, first victim first. O(n)."""
        return list(self._order)

    def entry_state(self, key: str) -> EntryState:
        """The state of ``key``'s entry (ABSENT when there is none)."""
        entry = self._entries.get(key)
        return ABSENT if entry is None else entry.state


    # ------------------------------------------------------------------ helpers
    def _pin_hits(
        self, rs: RequestState, items: Sequence[ItemLike]
    ) -> tuple[list[ItemStatus], bool]:
        """``Lookup`` of every item, the hits inlined (a READY, not doomed, matching entry:
        the table allows LOOKUP_HIT from READY, so no check is needed); whether any missed."""
        entries, holds, r = self._entries, rs.holds, rs.request_id
        statuses: list[ItemStatus] = []
        hits = 0
        missed = False
        for item in items:
            key = item.key
            entry = entries.get(key)
            if (
                entry is not None
                and entry.state is READY
                and not entry.doomed
                and entry.shape == item.shape
                and entry.dtype == item.dtype
            ):
                holders = entry.holders
                if r not in holders:
                    if holders:
                        entry.holders = holders | {r}
                    else:
                        entry.holders = frozenset((r,))
                        self._pinned_since[key] = self._clock()
                        if self._order.discard(key):
                            self._evictable_bytes -= entry.size
                    holds[key] = None
                hits += 1
                statuses.append(HIT)
            else:
                statuses.append(self.lookup(rs, item))
                missed = True
        self._counts["hits"] += hits
        return statuses, missed

    def _unpin_all(self, rs: RequestState) -> None:
        """``Release`` of every pin of ``rs`` in ``_release_order``, inlined for the common
        cases (another pin remains; the last pin of a plain entry, which joins the eviction
        order); a tainted or doomed entry's last pin goes through the action's own path."""
        entries, r, pinned_since = self._entries, rs.request_id, self._pinned_since
        order = self._order
        for key in _release_order(rs):
            entry = entries[key]
            holders = entry.holders
            if len(holders) > 1:
                entry.holders = holders - {r}
            elif entry.tainted or entry.doomed:
                del rs.holds[key]
                self._drop_pin(entry, r, Step.RELEASE_PIN)
                pinned_since = self._pinned_since
                continue
            else:
                entry.holders = NOBODY
                del pinned_since[key]
                order.add(key)
                self._evictable_bytes += entry.size
            del rs.holds[key]
        if not pinned_since:  # a dict keeps the table of its largest burst: start afresh
            self._pinned_since = {}

    def is_open(self, rs: RequestState) -> bool:
        """Whether ``rs`` is an open request of this core."""
        return self._requests.get(rs.request_id) is rs

    def has_request(self, request_id: str) -> bool:
        """Whether a request called ``request_id`` is open."""
        return request_id in self._requests

    def _start_misses(
        self,
        rs: RequestState,
        items: Sequence[ItemLike],
        statuses: list[ItemStatus],
        found: Mapping[str, bool],
        reserve: bool,
        store_error: bool,
        loads: list[Entry] | None = None,
    ) -> list[ItemStatus]:
        """Second pass over the NOT_FOUND items: join what others started meanwhile, else
        BeginLoad a store read (appended to ``loads``) or a reservation; then end the lookup."""
        entries = self._entries
        for i, item in enumerate(items):
            if statuses[i].reason is not NOT_FOUND:
                continue
            in_store = found.get(item.key, False)
            if item.key in entries:
                statuses[i] = self.lookup(rs, item)
            elif in_store or reserve:
                entry, reason = self.begin_load(rs, item, from_store=in_store)
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


def _release_order(rs: RequestState) -> list[str]:
    """The keys ``rs`` pins, in the order it looked them up, then the others (its own inserts)
    in the order it pinned them: released in this order, the last looked up ends newest."""
    holds = rs.holds
    order = [key for key in dict.fromkeys([item.key for item in rs.items]) if key in holds]
    if len(order) < len(holds):  # it also pins keys it inserted without looking them up
        looked = set(order)
        order += [key for key in holds if key not in looked]
    return order


def _fallback_reason(rs: RequestState, item: ItemLike) -> Reason | None:
    if item.key in rs.holds:
        return Reason.MISMATCH
    if item.key in rs.reserved:
        return Reason.NOT_FOUND  # reserved for this request: a miss it must encode
    if item.key in rs.waits:
        return Reason.TIMEOUT
    return rs.fallbacks.get(item.key)
