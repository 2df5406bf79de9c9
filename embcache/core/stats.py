"""``CacheStats``: a frozen snapshot of the cache, built from the core's state."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from embcache.core.allocator import BestFitAllocator
from embcache.core.build import loaded_build
from embcache.core.entries import Entry


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
    admissions_refused: int  # BeginLoads the policy refused (reason not_admitted)
    single_flight_joins: int
    fences: int
    build: str  # "compiled" (mypyc's extension modules) or "pure": embcache.core.build
    # failed publishes waiting for the store, and those dropped unpublished (oldest beyond the
    # bound; evicted, removed or quarantined first): ``embcache.driver.backlog``
    publish_backlog: int = 0
    publish_backlog_dropped: int = 0
    publish_backlog_stale: int = 0

    @property
    def entries(self) -> int:
        return sum(self.entries_by_state.values())


def snapshot(
    allocator: BestFitAllocator,
    entries: Iterable[Entry],
    open_requests: int,
    c: Counter[str],
    oldest_pin_age: float,
) -> CacheStats:
    """The stats of the core's state; ``oldest_pin_age`` in seconds. O(entries)."""
    by_state: Counter[str] = Counter()
    bytes_by_state: Counter[str] = Counter()
    pinned = []
    for e in entries:
        by_state[e.state.name] += 1
        bytes_by_state[e.state.name] += e.size
        if e.pins:
            pinned.append(e)
    free, largest = allocator.free_bytes, allocator.largest_free_block
    return CacheStats(
        capacity_bytes=allocator.capacity,
        allocated_bytes=allocator.allocated_bytes,
        free_bytes=free,
        largest_free_block=largest,
        fragmentation=(1.0 - largest / free) if free else 0.0,
        entries_by_state=dict(by_state),
        bytes_by_state=dict(bytes_by_state),
        pinned_entries=len(pinned),
        pinned_bytes=sum(e.size for e in pinned),
        oldest_pin_age_s=oldest_pin_age,
        open_requests=open_requests,
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
        admissions_refused=c["alloc_fail:not_admitted"],
        single_flight_joins=c["joins"],
        fences=c["fences"],
        build=loaded_build(),
    )


def _by_prefix(counts: Counter[str], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: v for k, v in counts.items() if k.startswith(prefix)}
