"""The entry lifecycle: the DESIGN actions that allocate, fill, free and quarantine an entry's
range (embcache/DESIGN.md, "Actions"): ``begin_load``, ``end_load``, ``evict``, ``remove``, and
the pin and order bookkeeping that ``Release`` and ``EndPublish`` share (``drop_pin``,
``add_holder``).

Each is a function of the state it changes (``embcache.core.state.CoreState``), named as in the
spec. Each checks the transition table of ``embcache.core.lifecycle`` before it changes
anything, buffers its trace event, and returns what the caller must now do (the entry whose
range to fill, the requests to wake). Called by the request bodies and by the publishes, never
by a driver. Pure and not thread-safe: the driver locks.
"""

from __future__ import annotations

from embcache.core.entries import NOBODY, Entry, Holder, ItemLike, RequestState
from embcache.core.eviction import VictimSearch, Window
from embcache.core.lifecycle import ABSENT, QUARANTINED, READY, Step, transition
from embcache.core.outcomes import Reason, TransferOutcome
from embcache.core.state import MAX_SHAPES, CoreState
from embcache.errors import InvariantError


def begin_load(
    st: CoreState, rs: RequestState, item: ItemLike, *, from_store: bool
) -> tuple[Entry | None, Reason | None]:
    """BeginLoad(r, k, n): allocate (evicting if the rule allows), LOADING, waiters = {r}.

    Returns the entry whose range the caller must now fill (a store read when ``from_store``,
    else the request's own insert), or None and the reason it failed."""
    existing = st.entries.get(item.key)
    transition(ABSENT if existing is None else existing.state, Step.BEGIN_LOAD)
    nbytes, align, allocator = item.nbytes, st.align, st.allocator
    if nbytes > allocator.capacity:
        return _alloc_failed(st, rs, item, Reason.TOO_LARGE)
    if type(nbytes) is int and nbytes > 0:
        size = (nbytes + align - 1) & -align  # the allocator's rounding, with no calls
    else:
        size = allocator.rounded(nbytes)  # raises the allocator's error
    offset = _allocate(st, item.key, size)
    if isinstance(offset, Reason):
        return _alloc_failed(st, rs, item, offset)
    shapes = st.shapes
    shape = shapes.get(item.shape)
    if shape is None:  # intern it; a full table starts afresh (MAX_SHAPES bounds it)
        if len(shapes) >= MAX_SHAPES:
            shapes.clear()
        shape = shapes[item.shape] = item.shape
    entry = Entry(item.key, shape, item.dtype, offset, size, waiters=frozenset({rs.request_id}))
    entry.filler = None if from_store else rs.request_id
    st.entries[item.key] = entry
    rs.waits.add(item.key)
    if not from_store:
        rs.reserved.add(item.key)
    st.counts["loads_started" if from_store else "reservations"] += 1
    if st.events is not None:
        st.emit("BeginLoad", rs.request_id, item.key, entry, outcome="OK")
    return entry, None


def end_load(
    st: CoreState, entry: Entry, outcome: TransferOutcome, failed_reason: Reason | None
) -> list[RequestState]:
    """EndLoad(k, outcome): READY with waiters pinned, or freed, or QUARANTINED. Returns the
    waiters, which the caller must wake."""
    if st.entries.get(entry.key) is not entry:
        raise InvariantError(f"EndLoad for {entry.key!r}, whose entry is gone")
    if outcome is TransferOutcome.OK and not entry.doomed:
        step = Step.END_LOAD_OK
    elif outcome is TransferOutcome.UNKNOWN:
        step = Step.END_LOAD_UNKNOWN
    else:
        step = Step.END_LOAD_DOOMED if entry.doomed else Step.END_LOAD_FAILED
    new_state = transition(entry.state, step)
    requests = st.requests
    waiters = [requests[r] for r in sorted(entry.waiters)]
    if entry.filler is not None:
        requests[entry.filler].reserved.discard(entry.key)
        entry.filler = None
    else:  # a store read
        st.counts["loads_" + outcome.name.lower()] += 1
    entry.state = new_state
    for rs in waiters:
        rs.waits.discard(entry.key)
    entry.waiters = NOBODY
    if step is Step.END_LOAD_OK:
        for rs in waiters:
            add_holder(st, entry, rs.request_id)
            rs.holds[entry.key] = None
        if not entry.holders:
            make_evictable(st, entry)
    else:
        reason = {
            Step.END_LOAD_DOOMED: Reason.REMOVED,
            Step.END_LOAD_UNKNOWN: Reason.LOAD_UNKNOWN,
        }.get(step, failed_reason or Reason.LOAD_FAILED)
        for rs in waiters:
            rs.fallbacks[entry.key] = reason
            st.counts["fallback:" + reason.value] += 1
        entry.doomed = False
        if new_state is ABSENT:
            free(st, entry)
        else:
            st.quarantine[entry.key] = st.clock()
    if st.events is not None:
        st.emit("EndLoad", None, entry.key, entry, outcome=outcome.name)
    return waiters


def evict(st: CoreState, entry: Entry, *, keep_range: bool = False) -> None:
    """Evict(k): free an idle READY entry chosen by the eviction rule. ``keep_range``: its
    range stays allocated, for the caller to give at once to the entry it evicted for."""
    if entry.pins or entry.doomed or entry.key not in st.order:
        raise InvariantError(f"eviction of {entry.key!r}, which is not evictable")
    entry.state = transition(entry.state, Step.EVICT)
    free(st, entry, keep_range=keep_range)
    st.counts["evictions"] += 1
    st.counts["evicted_bytes"] += entry.size
    if st.events is not None:
        st.emit("Evict", None, entry.key, entry)


def remove(st: CoreState, key: str) -> bool:
    """Remove(k): free now if idle, else doom; QUARANTINED entries wait for a fence. Whether
    it removed or doomed anything."""
    entry = st.entries.get(key)
    if entry is None or entry.doomed or entry.state is QUARANTINED:
        return False
    if entry.state is READY and not entry.pins:
        entry.state = transition(entry.state, Step.REMOVE_IDLE)
        free(st, entry)
    else:
        transition(entry.state, Step.REMOVE_BUSY)
        entry.doomed = True
    st.emit("Remove", None, key, entry)
    return True


def drop_pin(st: CoreState, entry: Entry, holder: Holder, plain: Step) -> None:
    """Drop ``holder``'s pin (``plain``: the step when it is not the last): the last pin
    quarantines a tainted entry, frees a doomed one, else the entry joins the eviction order."""
    holders = entry.holders
    last = len(holders) == 1 and holder in holders
    if last:
        if entry.tainted:
            plain = Step.RELEASE_LAST_TAINTED
        elif entry.doomed:
            plain = Step.RELEASE_LAST_DOOMED
    entry.state = transition(entry.state, plain)
    if not last:
        entry.holders = (holders - {holder}) or NOBODY
        return
    entry.holders = NOBODY
    del st.pinned_since[entry.key]
    if not st.pinned_since:  # a dict keeps the table of its largest burst: start afresh
        st.pinned_since = {}
    if plain is Step.RELEASE_LAST_DOOMED:
        free(st, entry)
    elif plain is Step.RELEASE_LAST_TAINTED:
        entry.tainted = entry.doomed = False
        st.quarantine[entry.key] = st.clock()
    else:
        make_evictable(st, entry)


def add_holder(st: CoreState, entry: Entry, holder: Holder) -> None:
    """Pin ``entry`` for ``holder``: the first pin takes it out of the eviction order."""
    if entry.holders:
        entry.holders |= {holder}
        return
    entry.holders = frozenset((holder,))
    st.pinned_since[entry.key] = st.clock()
    if st.order.discard(entry.key):
        st.evictable_bytes -= entry.size


def make_evictable(st: CoreState, entry: Entry) -> None:
    """``entry`` (idle, READY) enters the eviction order where its policy says."""
    st.order.add(entry.key)
    st.evictable_bytes += entry.size


def free(st: CoreState, entry: Entry, *, keep_range: bool = False) -> None:
    """Free ``entry``'s range (unless ``keep_range``) and forget it: ABSENT."""
    if not keep_range:
        st.allocator.free(entry.offset)
    if st.index is not None:
        st.index.gone(entry.offset, entry.size, keep_range)
    del st.entries[entry.key]
    if st.order.discard(entry.key):
        st.evictable_bytes -= entry.size
    elif st.quarantine:
        st.quarantine.pop(entry.key, None)
    st.policy.forget(entry.key)
    entry.state = ABSENT
    if st.freed is not None:
        st.freed.append((entry.offset, entry.size))


def _alloc_failed(
    st: CoreState, rs: RequestState, item: ItemLike, reason: Reason
) -> tuple[None, Reason]:
    st.counts["alloc_fail:" + reason.value] += 1
    st.emit("BeginLoad", rs.request_id, item.key, None, outcome=reason.name, size=item.nbytes)
    return None, reason


def _allocate(st: CoreState, key: str, size: int) -> int | Reason:
    """A range of ``size`` bytes for ``key``, evicting the victims the rule chooses if the
    policy admits ``key`` at their cost; else why not (nothing evicted)."""
    allocator = st.allocator
    free_bytes = allocator.free_bytes
    if free_bytes >= size and (offset := allocator.allocate(size)) is not None:
        return offset  # (a full pool skips the search for a block that cannot exist)
    if not st.enable_eviction or free_bytes + st.evictable_bytes < size:
        return Reason.NO_SPACE
    if (head := next(iter(st.order), None)) is None:
        return Reason.NO_SPACE  # (what the search says of no candidates)
    entries = st.entries
    first = entries[head]
    start: int
    stop: int
    start, stop = allocator.free_around(first.offset, first.offset + first.size)
    victims = [first]  # the search's first step, without the search: it alone fits
    if stop - start < size:
        window: Window | None = None
        index = st.index
        if index is not None and len(st.order) >= st.index_from:
            found = index.search(size)
            if found is not None:
                window, victims = found
        else:
            window, victims = _scan(st, size)
        if window is None:
            return Reason.NO_SPACE
        start = window.offset
    if not st.policy.admit(key, size, [victim.key for victim in victims]):
        return Reason.NOT_ADMITTED
    # One victim of exactly ``size`` with no free block before it: freeing its range and
    # allocating ``size`` would give that very range back and leave the allocator as it was
    # (no other free block fits, or the allocation above would have succeeded), so the range
    # passes to the new entry without either call.
    same = len(victims) == 1 and victims[0].size == size and victims[0].offset == start
    for victim in victims:
        evict(st, victim, keep_range=same)
    if same:
        return start
    offset = allocator.allocate(size)
    if offset != start:
        raise InvariantError(f"eviction freed a span at {start}; the allocator gave {offset}")
    return start


def _scan(st: CoreState, size: int) -> tuple[Window | None, list[Entry]]:
    """The rule's window for ``size`` bytes and its victims, by feeding ``VictimSearch`` the
    eviction order from its head (an order the eviction index cannot rank)."""
    examined: list[Entry] = []  # the candidates looked at, in eviction order
    search = VictimSearch.over(size, st.max_batch, st.allocator)
    entries = st.entries
    for candidate in st.order:
        entry = entries[candidate]
        examined.append(entry)
        window = search.add(entry.offset, entry.size)
        if window is not None:
            return window, [_examined_at(examined, offset) for offset in window.victims]
    return None, []


def _examined_at(examined: list[Entry], offset: int) -> Entry:
    """The candidate at ``offset``, searched from the newest: a window holds the newest
    candidate and at most ``max_batch`` victims, so a scan of plain int comparisons costs less
    than a dict keyed by offset filled for every candidate (one int object each)."""
    for index in range(len(examined) - 1, -1, -1):
        entry = examined[index]
        if entry.offset == offset:
            return entry
    raise InvariantError(f"the victim search chose {offset}, which it was not offered")
