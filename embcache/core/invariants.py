"""``check_core``: every DESIGN.md invariant of the core's state, checked from scratch.

Pure and slow on purpose (O(n log n)): it rebuilds what the core maintains incrementally (pins
from the requests' holds, the evictable set from the entries) and compares.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from embcache.core.allocator import BestFitAllocator
from embcache.core.entries import Entry, Holder, RequestState
from embcache.core.lifecycle import LOADING, QUARANTINED, READY
from embcache.errors import InvariantError


def _fail(what: str) -> None:
    raise InvariantError(f"cache invariant broken: {what}")


def check_core(
    allocator: BestFitAllocator,
    entries: Mapping[str, Entry],
    pinned_since: Mapping[str, float],
    requests: Mapping[str, RequestState],
    order: Collection[str],
    evictable_bytes: int,
    quarantine: Mapping[str, float],
    fencing: Iterable[tuple[Entry, ...]] = (),
) -> None:
    """Raise ``InvariantError`` naming the first broken invariant of the core's state.
    ``fencing``: the snapshots of the fences in flight (the entries each one took)."""
    for snapshot in fencing:  # QuarantineHolds, its fence marks: only a fence ends a quarantine
        for entry in snapshot:
            if entries.get(entry.key) is entry and entry.state is not QUARANTINED:
                _fail(f"{entry.key!r} is {entry.state.name} while a fence in flight holds it")
    allocator.check_invariants()
    spans = sorted((e.offset, e.size) for e in entries.values())
    if allocator.allocations() != spans:  # NoOverlap, Accounting
        _fail(f"allocations {allocator.allocations()} != entry ranges {spans}")
    if allocator.allocated_bytes != sum(s for _, s in spans):
        _fail("allocated bytes differ from the sum of entry sizes")
    holders: dict[str, set[Holder]] = {k: set() for k in entries}
    waiters: dict[str, set[str]] = {k: set() for k in entries}
    for r, rs in requests.items():
        if not rs.filling <= rs.reserved <= rs.waits or rs.holds.keys() & rs.waits:
            _fail(f"request {r!r} bookkeeping inconsistent")
        for key in rs.reserved:  # FillsExact: what it reserved, it fills
            if key not in entries or entries[key].filler != r:
                _fail(f"request {r!r} reserved {key!r}, which it does not fill")
        for key in rs.holds:
            holders.setdefault(key, set()).add(r)
        for key in rs.waits:
            waiters.setdefault(key, set()).add(r)
    for key, entry in entries.items():
        publish_pins = {h for h in entry.holders if not isinstance(h, str)}
        if entry.holders - publish_pins != holders.get(key, set()):  # PinsExact
            _fail(f"{key!r} holders {entry.holders} != requests holding it {holders.get(key)}")
        if len(publish_pins) != int(entry.publishing):
            _fail(f"{key!r} publish pins {publish_pins} but publishing={entry.publishing}")
        if entry.waiters != waiters.get(key, set()):
            _fail(f"{key!r} waiters {entry.waiters} != requests waiting {waiters.get(key)}")
        if entry.state is LOADING and entry.holders:
            _fail(f"LOADING {key!r} has pin holders")
        if entry.state is not LOADING and (entry.waiters or entry.filler):
            _fail(f"{entry.state.name} {key!r} has waiters or a filler")
        if entry.filler is not None and key not in requests[entry.filler].reserved:
            _fail(f"{key!r} is filled by {entry.filler!r}, which has not reserved it")
        if entry.state is QUARANTINED and (entry.holders or entry.doomed):
            _fail(f"QUARANTINED {key!r} is pinned or doomed")
        if entry.publishing and (entry.state is not READY or not entry.pins):
            _fail(f"{key!r} is published from while not READY and pinned")  # NoUseAfterFree
        if entry.doomed and not (entry.state is LOADING or entry.pins):  # DoomedIsBusy
            _fail(f"doomed {key!r} is idle")
        if entry.tainted and not entry.pins:
            _fail(f"tainted {key!r} is not pinned (it should be QUARANTINED)")
    if set(pinned_since) != {k for k, e in entries.items() if e.holders}:
        _fail(f"pin start times kept for {sorted(pinned_since)}, not for the pinned entries")
    idle = {
        k
        for k, e in entries.items()
        if e.state is READY and not e.pins and not e.doomed and not e.tainted
    }
    if len(order) != len(set(order)) or set(order) != idle:  # EvictableExact
        _fail(f"eviction order {list(order)} != evictable {sorted(idle)}")
    quarantined = {k for k, e in entries.items() if e.state is QUARANTINED}
    if set(quarantine) != quarantined:
        _fail(f"quarantine list {sorted(quarantine)} != QUARANTINED entries {sorted(quarantined)}")
    if evictable_bytes != sum(entries[k].size for k in order):
        _fail("evictable byte count drifted")
