"""A request's actions and bodies: OpenRequest, Lookup, Release and CloseRequest, and what a
step of ``embcache.core.cache_core.CacheCore`` composes of them (a lookup's two passes, what a
request may read, inserts and in-place fills and their one ending, a request's end).

Each is a function of the state it changes (``embcache.core.state.CoreState``). A request's
bookkeeping (``RequestState``: what it holds, waits for, fills and falls back on) changes only
here and in ``embcache.core.entry_actions``, through the named transitions of
embcache/DESIGN.md ("Request bookkeeping"): Pin, Join, Reserve, Load, HandOut, FallBack, Note,
Ask, Release, Close; ``tests/test_structure.py`` checks it. Lookup and Release live here, not
with the entry lifecycle: they are what a request does to entries, and an all-hit request runs
nothing else. What a request may read is derived, never stored (``served``). Pure and not
thread-safe: the driver locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from embcache.core.effects import Fill, Looked, Served
from embcache.core.entries import NOBODY, Entry, ItemLike, RequestState, matches
from embcache.core.entry_actions import begin_load, drop_pin, end_load
from embcache.core.lifecycle import LOADING, READY, Step, transition
from embcache.core.outcomes import (
    HIT,
    LOADING_STATUS,
    MISSES,
    RESERVED_STATUS,
    ItemStatus,
    Reason,
    TransferOutcome,
)
from embcache.core.policy import WorkPolicy
from embcache.core.state import CoreState
from embcache.errors import InvalidArgumentError

NOT_FOUND = Reason.NOT_FOUND
NOT_FOUND_MISS = MISSES[Reason.NOT_FOUND]
MISMATCH_MISS = MISSES[Reason.MISMATCH]
BUSY_MISS = MISSES[Reason.BUSY]
# A named tuple built without its Python-level ``__new__`` (a frame each): for the all-hit
# lookup, the hot path (``allocator._new_block`` does the same).
_NEW = tuple.__new__


# ---------------------------------------------------------------------- the request's actions
def open_request(st: CoreState, request_id: str) -> RequestState:
    """OpenRequest(r)."""
    rs = RequestState(request_id)
    st.requests[request_id] = rs
    if st.events is not None:
        st.emit("OpenRequest", request_id)
    return rs


def close_request(st: CoreState, rs: RequestState) -> None:
    """CloseRequest(r): the request holds, waits on and reserves nothing any more."""
    assert not (rs.holds or rs.waits or rs.reserved), "close releases everything first"
    del st.requests[rs.request_id]
    if st.events is not None:
        st.emit("CloseRequest", rs.request_id)


def next_batch_id(st: CoreState, kind: str) -> str:
    """A free id for an internal request (``insert#N``, ``republish#N``)."""
    st.batches += 1
    request_id = f"{kind}#{st.batches}"
    while request_id in st.requests:  # a caller's own request took the name
        st.batches += 1
        request_id = f"{kind}#{st.batches}"
    return request_id


def lookup_all(
    st: CoreState, rs: RequestState, items: Sequence[ItemLike]
) -> tuple[list[ItemStatus], bool]:
    """Lookup(r, k) of each item in order: pin a READY entry (a hit), join a LOADING one, else
    a miss. Returns the statuses and whether any item was not a hit. O(len(items)).

    The one body of ``Lookup``, traced or not: the event is its tail. The hit needs no table
    lookup (the table maps (READY, LOOKUP_HIT) to READY); a join checks the table."""
    entries, holds, r, events = st.entries, rs.holds, rs.request_id, st.events
    statuses: list[ItemStatus] = []
    hits = 0
    for item in items:
        key = item.key
        entry = entries.get(key)
        if entry is None:
            status = NOT_FOUND_MISS
        elif entry.shape != item.shape or entry.dtype != item.dtype:  # ``matches``
            status = MISMATCH_MISS
        elif entry.doomed:
            status = BUSY_MISS
        elif entry.state is READY:
            holders = entry.holders
            if r not in holders:  # (``entry_actions.add_holder``, inlined: the hot path)
                if holders:
                    entry.holders = holders | {r}
                else:
                    entry.holders = frozenset((r,))
                    st.pinned_since[key] = st.clock()
                    if st.order.discard(key):
                        st.evictable_bytes -= entry.size
                holds[key] = None
            hits += 1
            status = HIT
        elif entry.state is LOADING:
            transition(LOADING, Step.LOOKUP_JOIN)
            if r not in entry.waiters:
                entry.waiters |= {r}
                rs.waits.add(key)
                st.counts["joins"] += 1
            status = RESERVED_STATUS if entry.filler == r else LOADING_STATUS
        else:
            status = BUSY_MISS
        statuses.append(status)
        if events is not None:
            reason = None if status.reason is None else status.reason.value
            st.emit("Lookup", r, key, entry, outcome=status.status.name, reason=reason)
    if hits:
        st.counts["hits"] += hits
    return statuses, hits != len(statuses)  # (only the hit branch says HIT)


def release_all(st: CoreState, rs: RequestState, keys: Iterable[str]) -> None:
    """Release(r, k) of each key in order: drop r's wait or pin; the last pin quarantines (a
    publish ended UNKNOWN), frees (doomed) or idles the entry. O(len(keys)).

    The one body of ``Release``, traced or not: the event is its tail. Holders are READY
    entries only, so a plain pin needs no table lookup unless the state is not READY (then
    ``transition`` raises, as the table says)."""
    entries, r, events = st.entries, rs.request_id, st.events
    waits, holds = rs.waits, rs.holds
    for key in keys:
        entry = entries[key]
        if key in waits:
            transition(entry.state, Step.RELEASE_WAIT)
            entry.waiters = (entry.waiters - {r}) or NOBODY
            waits.discard(key)
        else:
            if entry.state is not READY:
                transition(entry.state, Step.RELEASE_PIN)  # raises: holders are READY
            del holds[key]
            holders = entry.holders
            if len(holders) > 1:
                entry.holders = holders - {r}
            elif entry.tainted or entry.doomed:  # (r holds it: it is in rs.holds)
                drop_pin(st, entry, r, Step.RELEASE_PIN)
            else:  # the last pin of a plain entry: it joins the eviction order
                entry.holders = NOBODY
                del st.pinned_since[key]
                st.order.add(key)
                st.evictable_bytes += entry.size
        if events is not None:
            st.emit("Release", r, key, entry)
    if not st.pinned_since:  # a dict keeps the table of its largest burst: start afresh
        st.pinned_since = {}


# ---------------------------------------------------------------------- lookups
def lookup_request(
    st: CoreState, rs: RequestState, items: Sequence[ItemLike], ask_store: bool, reserve: bool,
    serve: bool,
) -> Looked:  # fmt: skip
    """A lookup's first pass (the hot path: its flags by position, from ``CacheCore``'s step,
    which takes them by name): Lookup each item (the policy records each key), then, when some
    item missed, TOO_LARGE for a miss larger than the pool and either the keys to ask the
    store about (Ask: ``finish_lookup`` ends the lookup) or the misses reserved (Reserve) and
    the lookup ended (Note, FallBack). Once it is over, and when ``serve``, what ``rs`` may
    read if nothing is pending."""
    record = st.record
    if record is not None:
        for item in items:
            record(item.key)
    first = not rs.items
    statuses, missed = lookup_all(st, rs, items)
    fills: list[Fill] = []
    if not missed:  # all hits: nothing to fall back on (Note)
        rs.items.extend(items)
        if serve and first:  # its only lookup: what it may read is the hits
            entries = st.entries
            ranges: list[tuple[int, ItemLike] | None]
            ranges = [(entries[it.key].offset, it) for it in items]
            hits = _NEW(Served, (ranges, [None] * len(items), True))
            return _NEW(Looked, (rs, statuses, [], hits, fills))
        return Looked(rs, statuses, [], served(st, rs) if serve else None, fills)
    capacity = st.allocator.capacity
    not_found = False
    for i, item in enumerate(items):
        if statuses[i].reason is NOT_FOUND:
            if item.nbytes > capacity:
                statuses[i] = MISSES[Reason.TOO_LARGE]
            else:
                not_found = True
    if not (not_found and (ask_store or reserve)):
        _end_lookup(st, rs, items, statuses)
    elif not ask_store:
        statuses = _start_misses(st, rs, items, statuses, {}, reserve, False, None, fills)
    else:
        rs.lookup_pending = (list(items), statuses, reserve)  # Ask
        pairs = zip(items, statuses, strict=True)
        ask = sorted({it.key for it, s in pairs if s.reason is NOT_FOUND})
        return Looked(rs, statuses, ask, None, fills)
    answer = served(st, rs) if serve and not rs.pending() else None
    return Looked(rs, statuses, [], answer, fills)


def finish_lookup(
    st: CoreState, rs: RequestState, found: Mapping[str, bool] | None, loads: list[Entry],
    fills: list[Fill] | None,
) -> list[ItemStatus]:  # fmt: skip
    """A lookup's second pass once the store said which asked keys it holds (``found``; None:
    the store failed): join what others started meanwhile, else start a store read (Load,
    appended to ``loads``) or a reservation (Reserve); the final statuses (none when no second
    pass is pending)."""
    pending = rs.lookup_pending
    if pending is None:  # no second pass pending: nothing to do
        return []
    rs.lookup_pending = None
    items, statuses, reserve = pending
    return _start_misses(st, rs, items, statuses, found or {}, reserve, found is None, loads, fills)


def served(st: CoreState, rs: RequestState) -> Served:
    """Per looked-up item, the range it may read (offset and item) or None, and why each
    unserved one falls back. O(items)."""
    holds, entries = rs.holds, st.entries
    ranges: list[tuple[int, ItemLike] | None] = []
    reasons: list[Reason | None] = []
    for item in rs.items:
        entry = entries[item.key] if item.key in holds else None
        if entry is None or not matches(entry, item):
            ranges.append(None)
            reasons.append(rs.fallback_reason(item))
        else:
            ranges.append((entry.offset, item))
            reasons.append(None)
    return Served(ranges, reasons, not rs.pending())


# ---------------------------------------------------------------------- inserts and fills
def plan_fills(
    st: CoreState, rs: RequestState, items: Sequence[ItemLike], *, hand_out: bool
) -> list[Fill]:
    """The LOADING entries ``rs`` must now fill, each with its item's index: its reservations,
    and a BeginLoad (Reserve) for each absent key (a duplicate key once); ``hand_out``: each is
    handed to an outside writer (HandOut). Raises (changing nothing) when a reserved key's
    shape or dtype differs from the reservation."""
    entries = st.entries
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
    for i, item in enumerate(items):
        key = item.key
        if key in planned:
            continue  # a duplicate key is inserted once
        if key in rs.reserved:
            fills.append((i, entries[key]))
            planned.add(key)
        elif key not in entries:
            entry, _ = begin_load(st, rs, item, from_store=False)
            if entry is not None:
                fills.append((i, entry))
                planned.add(key)
    if hand_out:
        rs.filling.update(entry.key for _, entry in fills)  # HandOut
    return fills


def end_fills(
    st: CoreState, rs: RequestState, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome],
    *, count: int, handed_out: bool, work: Sequence[tuple[str, float, int]] | None,
) -> tuple[list[bool], list[RequestState]]:  # fmt: skip
    """The one load-ending path of an insert, a request-less batch and an in-place fill: EndLoad
    each of ``rs``'s fills with its writer's outcome (OK: READY, pinned by its waiters). With
    ``handed_out``, a fill that is not (or no longer) handed out to a writer is left alone.
    ``work`` (checked by the caller; None: unknown): ``(key, seconds, nbytes)`` of each output
    encoded, told to a policy that keeps work (``WorkPolicy``) after the loads end:
    ``note_work`` where the key's entry is READY, else ``note_encoded``. Which of ``count``
    items are cached now, and the requests to wake."""
    results = [False] * count
    wake: list[RequestState] = []
    entries, filling = st.entries, rs.filling
    for (i, entry), outcome in zip(fills, outcomes, strict=True):
        if handed_out:
            if entry.key not in filling or entries.get(entry.key) is not entry:
                continue
            filling.discard(entry.key)  # (the fill ends: no longer handed out)
        wake += end_load(st, entry, outcome, Reason.LOAD_FAILED)
        results[i] = entry.state is READY
    st.counts["inserts"] += sum(results)
    if work is not None and st.work_policy is not None:
        _note_work(st, st.work_policy, work)
    return results, wake


def _note_work(st: CoreState, policy: WorkPolicy, work: Sequence[tuple[str, float, int]]) -> None:
    """Tell ``policy`` each output's encoder seconds: cached (its entry READY) or not."""
    entries, align = st.entries, st.align
    for key, seconds, nbytes in work:
        entry = entries.get(key)
        if entry is not None and entry.state is READY:
            policy.note_work(key, seconds, entry.size)
        else:
            policy.note_encoded(key, seconds, max((nbytes + align - 1) & -align, align))


# ---------------------------------------------------------------------- the end
def end_request(st: CoreState, rs: RequestState) -> list[RequestState]:
    """End every reservation of ``rs`` (its waiters fall back; a range still handed out ends
    UNKNOWN: quarantined), release every wait and pin in lookup order, then CloseRequest; the
    requests to wake."""
    rs.lookup_pending = None
    wake: list[RequestState] = []
    if rs.reserved:
        entries = st.entries
        for key in sorted(rs.reserved):
            outcome = TransferOutcome.UNKNOWN if key in rs.filling else TransferOutcome.FAILED
            wake += end_load(st, entries[key], outcome, Reason.ABANDONED)
        rs.filling.clear()
    if rs.waits:
        release_all(st, rs, sorted(rs.waits))
    release_all(st, rs, rs.release_order())
    close_request(st, rs)
    return wake


# ---------------------------------------------------------------------- helpers
def _start_misses(
    st: CoreState, rs: RequestState, items: Sequence[ItemLike], statuses: list[ItemStatus],
    found: Mapping[str, bool], reserve: bool, store_error: bool, loads: list[Entry] | None,
    fills: list[Fill] | None,
) -> list[ItemStatus]:  # fmt: skip
    """Second pass over the NOT_FOUND items: join what others started meanwhile, else BeginLoad
    a store read (appended to ``loads``) or a reservation (to ``fills``); then end the
    lookup."""
    entries = st.entries
    for i, item in enumerate(items):
        if statuses[i].reason is not NOT_FOUND:
            continue
        in_store = found.get(item.key, False)
        if item.key in entries:
            statuses[i] = lookup_all(st, rs, (item,))[0][0]
        elif in_store or reserve:
            entry, reason = begin_load(st, rs, item, from_store=in_store)
            if entry is None:
                assert reason is not None, "a failed BeginLoad names its reason"
                statuses[i] = MISSES[reason]
            elif in_store:
                assert loads is not None, "a store read only after the store was asked"
                loads.append(entry)
                statuses[i] = LOADING_STATUS
            else:
                statuses[i] = RESERVED_STATUS
                if fills is not None:
                    fills.append((i, entry))
        if statuses[i].reason is NOT_FOUND and store_error:
            statuses[i] = MISSES[Reason.STORE_ERROR]
    _end_lookup(st, rs, items, statuses)
    return statuses


def _end_lookup(
    st: CoreState, rs: RequestState, items: Sequence[ItemLike], statuses: Sequence[ItemStatus]
) -> None:
    """Note the items and FallBack on each miss's reason; count the misses."""
    counts = st.counts
    for item, status in zip(items, statuses, strict=True):
        reason = status.reason
        if reason is not None:
            rs.fallbacks[item.key] = reason
            counts["miss:" + reason.value] += 1
    rs.items.extend(items)
