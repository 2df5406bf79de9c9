"""``StateQueries``: the read-only view of the core's state (``CacheCore.queries``).

It holds the state privately and answers questions about it; no member changes the state, and
none hands out a part of it that could (the allocator stays inside: ``allocator_copy`` is a copy;
the mappings are read-only views). The entries it shows are the core's own records: read them,
never write them. ``tests/test_core.py`` calls every public member and checks that the state is
unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType

from embcache.core.allocator import BestFitAllocator
from embcache.core.entries import Entry, RequestState
from embcache.core.invariants import check_core
from embcache.core.lifecycle import ABSENT, EntryState
from embcache.core.state import CoreState
from embcache.core.stats import CacheStats, snapshot


class StateQueries:
    """Read-only queries over one ``CoreState`` (module docstring)."""

    def __init__(self, state: CoreState) -> None:
        self._state = state

    @property
    def capacity(self) -> int:
        """Pool size in bytes."""
        return self._state.allocator.capacity

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken DESIGN.md invariant. O(n log n)."""
        st = self._state
        check_core(
            st.allocator, st.entries, st.pinned_since, st.requests, st.order,
            st.evictable_bytes, st.quarantine, st.fencing.values(),
        )  # fmt: skip

    def stats(self, now: float) -> CacheStats:
        """A snapshot of the state and counters at ``now`` (of this core's clock)."""
        st = self._state
        return snapshot(
            st.allocator,
            st.entries.values(),
            len(st.requests),
            st.counts,
            now - min(st.pinned_since.values(), default=now),
        )

    @property
    def entries(self) -> Mapping[str, Entry]:
        """Every entry by key (a read-only view; the entries are the core's: do not edit)."""
        return MappingProxyType(self._state.entries)

    @property
    def requests(self) -> Mapping[str, RequestState]:
        """Every open request by id (a read-only view)."""
        return MappingProxyType(self._state.requests)

    @property
    def counts(self) -> Mapping[str, int]:
        """The counters (a read-only view)."""
        return MappingProxyType(self._state.counts)

    @property
    def quarantine(self) -> Mapping[str, float]:
        """QUARANTINED keys and when each was quarantined (a read-only view)."""
        return MappingProxyType(self._state.quarantine)

    @property
    def pinned_since(self) -> Mapping[str, float]:
        """Pinned keys and when their first pin came (a read-only view)."""
        return MappingProxyType(self._state.pinned_since)

    def allocator_copy(self) -> BestFitAllocator:
        """A copy of the allocator (``free_blocks()``, ``allocations()``...). O(blocks)."""
        return copy.deepcopy(self._state.allocator)

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated to entries (rounded to the alignment). O(1)."""
        return self._state.allocator.allocated_bytes

    @property
    def evictable_bytes(self) -> int:
        """Bytes of the entries in the eviction order."""
        return self._state.evictable_bytes

    @property
    def shapes(self) -> int:
        """How many distinct item shapes are interned (at most ``MAX_SHAPES``)."""
        return len(self._state.shapes)

    def eviction_order(self) -> list[str]:
        """The evictable keys, first victim first. O(n)."""
        return list(self._state.order)

    def entry_state(self, key: str) -> EntryState:
        """The state of ``key``'s entry (ABSENT when there is none)."""
        entry = self._state.entries.get(key)
        return ABSENT if entry is None else entry.state

    @property
    def fences_in_flight(self) -> int:
        """How many fences began and have neither ended nor been abandoned. O(1)."""
        return len(self._state.fencing)

    def fence_due(self, now: float, max_bytes: int, max_age: float) -> bool:
        """Whether the automatic fence should run: more than ``max_bytes`` quarantined, or a
        range quarantined for ``max_age`` or longer (``now`` on the core's clock). O(q)."""
        st = self._state
        if not st.quarantine:
            return False
        quarantined = sum(st.entries[key].size for key in st.quarantine)
        return quarantined > max_bytes or now - min(st.quarantine.values()) >= max_age
