"""Read-only queries over the cache's state: ``StateQueries``, a base of ``Actions`` and the
type of ``CacheCore.queries`` (the one object a driver reads the state through). Nothing here
changes any state, except ``take_events`` and ``take_freed``, which hand over (and empty) the
buffers the actions filled (the core's steps take them; a driver has no reason to).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from embcache.core.allocator import BestFitAllocator
from embcache.core.entries import Entry, RequestState
from embcache.core.invariants import check_core
from embcache.core.lifecycle import ABSENT, EntryState
from embcache.core.stats import CacheStats, snapshot

if TYPE_CHECKING:
    from embcache.core.policy import EvictionOrder


class StateQueries:
    """The read-only queries of ``Actions`` (its state's fields, declared here for typing)."""

    _allocator: BestFitAllocator
    _entries: dict[str, Entry]
    _requests: dict[str, RequestState]
    _counts: Counter[str]
    _quarantine: dict[str, float]
    _pinned_since: dict[str, float]
    _order: EvictionOrder
    _evictable_bytes: int
    _shapes: dict[tuple[int, ...], tuple[int, ...]]
    _fencing: dict[int, tuple[Entry, ...]]
    _events: list[dict[str, Any]] | None
    _freed: list[tuple[int, int]] | None

    @property
    def capacity(self) -> int:
        """Pool size in bytes."""
        return self._allocator.capacity

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken DESIGN.md invariant. O(n log n)."""
        check_core(
            self._allocator,
            self._entries,
            self._pinned_since,
            self._requests,
            self._order,
            self._evictable_bytes,
            self._quarantine,
            self._fencing.values(),
        )

    def stats(self, now: float) -> CacheStats:
        """A snapshot of the state and counters at ``now`` (of this core's clock)."""
        return snapshot(
            self._allocator,
            self._entries.values(),
            len(self._requests),
            self._counts,
            now - min(self._pinned_since.values(), default=now),
        )

    # ------------------------------------------------------------------ read-only queries
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

    @property
    def shapes(self) -> int:
        """How many distinct item shapes are interned (at most ``MAX_SHAPES``)."""
        return len(self._shapes)

    def eviction_order(self) -> list[str]:
        """The evictable keys, first victim first. O(n)."""
        return list(self._order)

    def entry_state(self, key: str) -> EntryState:
        """The state of ``key``'s entry (ABSENT when there is none)."""
        entry = self._entries.get(key)
        return ABSENT if entry is None else entry.state

    # ------------------------------------------------------------------ buffers to take
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

    @property
    def fences_in_flight(self) -> int:
        """How many fences began and have neither ended nor been abandoned. O(1)."""
        return len(self._fencing)

    def fence_due(self, now: float, max_bytes: int, max_age: float) -> bool:
        """Whether the automatic fence should run: more than ``max_bytes`` quarantined, or a
        range quarantined for ``max_age`` or longer (``now`` on the core's clock). O(q)."""
        if not self._quarantine:
            return False
        quarantined = sum(self._entries[key].size for key in self._quarantine)
        return quarantined > max_bytes or now - min(self._quarantine.values()) >= max_age
