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
from embcache.core.entries import Entry, ItemLike, RequestState, matches
from embcache.core.lifecycle import ABSENT, READY, EntryState
from embcache.core.outcomes import (
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
        the lookup is over (misses reserved when ``reserve``). O(len(items))."""
        record = self._record
        if record is not None:
            for item in items:
                record(item.key)
        statuses = []
        lookup, capacity = self.lookup, self.capacity
        for item in items:
            status = lookup(rs, item)
            if status.reason is NOT_FOUND and item.nbytes > capacity:
                status = MISSES[Reason.TOO_LARGE]
            statuses.append(status)
        if not (ask_store or reserve) or all(s.reason is not NOT_FOUND for s in statuses):
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
        """End every reservation of ``rs`` (its waiters fall back), release every wait and pin
        in lookup order, then CloseRequest. Returns the requests to wake."""
        rs.lookup_pending = None
        wake: list[RequestState] = []
        for key in sorted(rs.reserved):
            wake += self.end_load(self._entries[key], TransferOutcome.FAILED, Reason.ABANDONED)
        for key in sorted(rs.waits):
            self.release(rs, key)
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
