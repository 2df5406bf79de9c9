"""How a request's calls compose the core's DESIGN actions: its lookup (two passes around a
store ``exists``), its insert (BeginLoad, a copy by the driver, EndLoad), its close, and what it
may read or must encode.

Pure functions over a ``CacheCore``; the driver calls each with its lock held and does the
store calls and copies in between with no lock held.
"""

from __future__ import annotations

from collections.abc import Sequence

from embcache.core.cache_core import CacheCore
from embcache.core.entries import (
    LOADING_STATUS,
    MISSES,
    RESERVED_STATUS,
    Entry,
    ItemLike,
    RequestState,
)
from embcache.core.lifecycle import READY
from embcache.core.outcomes import ItemStatus, Reason, TransferOutcome
from embcache.errors import InvalidArgumentError


def lookup_all(core: CacheCore, rs: RequestState, items: Sequence[ItemLike]) -> list[ItemStatus]:
    """``lookup`` each item; a miss larger than the pool is TOO_LARGE. O(len(items))."""
    if core.record is not None:
        for item in items:
            core.record(item.key)
    statuses = []
    lookup = core.lookup
    for item in items:
        status = lookup(rs, item)
        if status.reason is Reason.NOT_FOUND and item.nbytes > core.capacity:
            status = MISSES[Reason.TOO_LARGE]
        statuses.append(status)
    return statuses


def start_misses(
    core: CacheCore,
    rs: RequestState,
    items: Sequence[ItemLike],
    statuses: list[ItemStatus],
    found: dict[str, bool],
    *,
    reserve: bool,
    store_error: bool,
) -> list[Entry]:
    """Second pass over the NOT_FOUND items after the store was asked (``found``): join
    what others started meanwhile, else BeginLoad a store read or a reservation.

    Updates ``statuses`` in place; returns the entries the caller must read from the store.
    """
    loads: list[Entry] = []
    for i, item in enumerate(items):
        if statuses[i].reason is not Reason.NOT_FOUND:
            continue
        in_store = found.get(item.key, False)
        if item.key in core.entries:
            statuses[i] = core.lookup(rs, item)
        elif in_store or reserve:
            entry, reason = core.begin_load(rs, item, from_store=in_store)
            if entry is None:
                assert reason is not None, "a failed BeginLoad names its reason"
                statuses[i] = MISSES[reason]
            elif in_store:
                loads.append(entry)
                statuses[i] = LOADING_STATUS
            else:
                statuses[i] = RESERVED_STATUS
        if statuses[i].reason is Reason.NOT_FOUND and store_error:
            statuses[i] = MISSES[Reason.STORE_ERROR]
    return loads


def record(
    core: CacheCore, rs: RequestState, items: Sequence[ItemLike], statuses: Sequence[ItemStatus]
) -> None:
    """End a lookup: note the items and each miss's reason (for ``fallback``)."""
    for item, status in zip(items, statuses, strict=True):
        reason = status.reason
        if reason is not None:
            rs.fallbacks[item.key] = reason
            core.counts["miss:" + reason.value] += 1
    rs.items.extend(items)


def plan_insert(
    core: CacheCore, rs: RequestState, items: Sequence[ItemLike]
) -> list[tuple[int, Entry]]:
    """The LOADING entries that ``rs`` must now fill with ``items[i]``: its reservations,
    and a BeginLoad for each absent key (a duplicate key once). Raises (changing
    nothing) when a reserved key's shape or dtype differs from the reservation."""
    for item in items:
        if item.key in rs.reserved:
            expected = core.entries[item.key]
            if (expected.shape, expected.dtype) != (item.shape, item.dtype):
                raise InvalidArgumentError(
                    f"tensor for {item.key!r} has shape {item.shape} and dtype "
                    f"{item.dtype}, but it was reserved as {expected.shape} {expected.dtype}"
                )
    filling: list[tuple[int, Entry]] = []
    planned: set[str] = set()
    for i, item in enumerate(items):
        if item.key in planned:
            continue  # a duplicate key is inserted once
        if item.key in rs.reserved:
            filling.append((i, core.entries[item.key]))
        elif item.key not in core.entries:
            entry, _ = core.begin_load(rs, item, from_store=False)
            if entry is not None:
                filling.append((i, entry))
        if filling and filling[-1][0] == i:
            planned.add(item.key)
    return filling


def finish_insert(
    core: CacheCore,
    filling: list[tuple[int, Entry]],
    outcomes: Sequence[TransferOutcome],
    count: int,
) -> tuple[list[bool], list[RequestState]]:
    """EndLoad each filled entry; returns which of ``count`` items are cached now, and
    the requests to wake."""
    results = [False] * count
    notify: list[RequestState] = []
    for (i, entry), outcome in zip(filling, outcomes, strict=True):
        notify += core.end_load(entry, outcome, Reason.LOAD_FAILED)
        results[i] = entry.state is READY
    core.counts["inserts"] += sum(results)
    return results, notify


def end_request(core: CacheCore, rs: RequestState) -> list[RequestState]:
    """End every reservation of ``rs`` (its waiters fall back), release every wait and pin,
    then CloseRequest. Returns the requests to wake."""
    notify: list[RequestState] = []
    for key in sorted(rs.reserved):
        notify += core.end_load(core.entries[key], TransferOutcome.FAILED, Reason.ABANDONED)
    for key in sorted(rs.waits):
        core.release(rs, key)
    for key in release_order(rs):
        core.release(rs, key)
    core.close_request(rs)
    return notify


def release_order(rs: RequestState) -> list[str]:
    """The keys ``rs`` pins, in the order it looked them up, then the others (its own inserts)
    in the order it pinned them: released in this order, the last looked up ends newest."""
    holds = rs.holds
    order = [key for key in dict.fromkeys([item.key for item in rs.items]) if key in holds]
    if len(order) < len(holds):  # it also pins keys it inserted without looking them up
        looked = set(order)
        order += [key for key in holds if key not in looked]
    return order


def served(core: CacheCore, rs: RequestState) -> list[tuple[int, ItemLike] | None]:
    """Per looked-up item, the range it may read (offset and item) or None."""
    return [(core.entries[it.key].offset, it) if _serves(core, rs, it) else None for it in rs.items]


def fallback(core: CacheCore, rs: RequestState) -> tuple[list[int], list[Reason | None]]:
    """Per looked-up item: 1 where the caller must encode it, and why."""
    served = [_serves(core, rs, it) for it in rs.items]
    reasons = [
        None if ok else _fallback_reason(rs, it) for it, ok in zip(rs.items, served, strict=True)
    ]
    return [0 if ok else 1 for ok in served], reasons


def _serves(core: CacheCore, rs: RequestState, item: ItemLike) -> bool:
    """Whether ``rs`` holds ``item``'s entry with the item's own shape and dtype."""
    if item.key not in rs.holds:
        return False
    held = core.entries[item.key]
    return held.shape == item.shape and held.dtype == item.dtype


def _fallback_reason(rs: RequestState, item: ItemLike) -> Reason | None:
    if item.key in rs.holds:
        return Reason.MISMATCH
    if item.key in rs.reserved:
        return Reason.NOT_FOUND  # reserved for this request: a miss it must encode
    if item.key in rs.waits:
        return Reason.TIMEOUT
    return rs.fallbacks.get(item.key)
