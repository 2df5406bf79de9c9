"""The DESIGN actions over the cache's state: entries, pins, waits, the allocator, the order.

Theory of operation (after h11's ``Connection``). ``Actions`` holds every piece of state that
DESIGN.md talks about and changes it only through the DESIGN actions, one method each, named as
in the spec: ``open_request``, ``close_request``, ``lookup``, ``begin_load``, ``end_load``,
``release``, ``evict``, ``remove``, ``publish``, ``end_publish``, ``fence``. Each checks the
transition table of ``embcache.core.lifecycle`` before it changes anything, buffers its trace
event (when tracing), and returns what the caller must now do: the entry whose range to fill or
publish, the requests to wake. ``CacheCore`` (``embcache.core.cache_core``) composes these
actions into a request's steps; the driver takes the buffered events and freed ranges from it.

No threads, no clock, no torch and no store: not thread-safe; the driver calls in only while
holding its lock. Items are duck-typed (``key``, ``shape``, ``dtype``, ``nbytes``). The time a
pin starts comes from the ``clock`` the driver passes in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from embcache.core.allocator import BestFitAllocator
from embcache.core.entries import (
    NOBODY,
    Entry,
    FenceSnapshot,
    Holder,
    ItemLike,
    RequestState,
)
from embcache.core.eviction import VictimSearch, Window
from embcache.core.lifecycle import (
    ABSENT,
    LOADING,
    QUARANTINED,
    READY,
    Step,
    transition,
)
from embcache.core.outcomes import (
    HIT,
    LOADING_STATUS,
    MISSES,
    RESERVED_STATUS,
    ItemStatus,
    Reason,
    TransferOutcome,
)
from embcache.core.policy import LruPolicy, Policy, WorkPolicy
from embcache.core.queries import StateQueries
from embcache.errors import InvariantError

NOT_FOUND_MISS = MISSES[Reason.NOT_FOUND]
MISMATCH_MISS = MISSES[Reason.MISMATCH]
BUSY_MISS = MISSES[Reason.BUSY]
MAX_SHAPES = 4096  # distinct item shapes interned at once (entries share one tuple per shape)


class Actions(StateQueries):
    """All cache state and the DESIGN actions over it. Not thread-safe: the driver locks."""

    def __init__(
        self,
        capacity: int,
        alignment: int,
        max_eviction_batch: int,
        enable_eviction: bool,
        *,
        trace: bool = False,
        clock: Callable[[], float] = float,
        policy: Policy | None = None,
        record_freed: bool = False,
    ) -> None:
        self._allocator = BestFitAllocator(capacity, alignment)
        self._align = alignment
        self._max_batch = max_eviction_batch
        self._enable_eviction = enable_eviction
        self._events: list[dict[str, Any]] | None = [] if trace else None  # until taken
        self._clock = clock
        self._seq = 0
        self._entries: dict[str, Entry] = {}
        self._pinned_since: dict[str, float] = {}  # pinned keys -> when the first pin came
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # interned: <= MAX_SHAPES
        self._policy: Policy = LruPolicy() if policy is None else policy
        self._order = self._policy.order()  # the evictable keys, first victim first
        # The policy's record of each looked-up key; None when it records nothing (lru).
        records = getattr(self._policy, "records_lookups", True)
        self._record = self._policy.record if records else None
        # The policy that keeps fresh outputs' encoder work; None when it keeps none.
        works = getattr(self._policy, "records_work", False)
        self._work_policy: WorkPolicy | None = self._policy if works else None  # type: ignore[assignment]
        self._evictable_bytes = 0
        self._requests: dict[str, RequestState] = {}
        self._batches = 0  # request-less inserts so far (their internal requests' ids)
        self._counts: Counter[str] = Counter()
        self._quarantine: dict[str, float] = {}  # QUARANTINED keys -> when (core clock)
        self._fences_begun = 0  # the id of the last BeginFence
        self._fencing: dict[int, tuple[Entry, ...]] = {}  # fences in flight -> their snapshots
        self._freed: list[tuple[int, int]] | None = [] if record_freed else None  # until taken
        self._emit(
            "Init", None, capacity=capacity, alignment=alignment,
            max_eviction_batch=max_eviction_batch, enable_eviction=enable_eviction,
        )  # fmt: skip

    # ------------------------------------------------------------------ the DESIGN actions
    def open_request(self, request_id: str) -> RequestState:
        """OpenRequest(r)."""
        rs = RequestState(request_id)
        self._requests[request_id] = rs
        if self._events is not None:
            self._emit("OpenRequest", request_id)
        return rs

    def close_request(self, rs: RequestState) -> None:
        """CloseRequest(r): the request holds, waits on and reserves nothing any more."""
        assert not (rs.holds or rs.waits or rs.reserved), "close releases everything first"
        del self._requests[rs.request_id]
        if self._events is not None:
            self._emit("CloseRequest", rs.request_id)

    def lookup(self, rs: RequestState, item: ItemLike) -> ItemStatus:
        """Lookup(r, k) of one item (``lookup_all`` of one)."""
        return self.lookup_all(rs, (item,))[0][0]

    def lookup_all(
        self, rs: RequestState, items: Sequence[ItemLike]
    ) -> tuple[list[ItemStatus], bool]:
        """Lookup(r, k) of each item in order: pin a READY entry (a hit), join a LOADING one,
        else a miss. Returns the statuses and whether any item was not a hit. O(len(items)).

        The one body of ``Lookup``, traced or not: the event is its tail. The hit needs no
        table lookup (the table maps (READY, LOOKUP_HIT) to READY); a join checks the table."""
        entries, holds, r, events = self._entries, rs.holds, rs.request_id, self._events
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
                if r not in holders:  # (``_add_holder``, inlined: the hot path)
                    if holders:
                        entry.holders = holders | {r}
                    else:
                        entry.holders = frozenset((r,))
                        self._pinned_since[key] = self._clock()
                        if self._order.discard(key):
                            self._evictable_bytes -= entry.size
                    holds[key] = None
                hits += 1
                status = HIT
            elif entry.state is LOADING:
                transition(LOADING, Step.LOOKUP_JOIN)
                if r not in entry.waiters:
                    entry.waiters |= {r}
                    rs.waits.add(key)
                    self._counts["joins"] += 1
                status = RESERVED_STATUS if entry.filler == r else LOADING_STATUS
            else:
                status = BUSY_MISS
            statuses.append(status)
            if events is not None:
                reason = None if status.reason is None else status.reason.value
                self._emit("Lookup", r, key, entry, outcome=status.status.name, reason=reason)
        if hits:
            self._counts["hits"] += hits
        return statuses, hits != len(statuses)  # (only the hit branch says HIT)

    def begin_load(
        self, rs: RequestState, item: ItemLike, *, from_store: bool
    ) -> tuple[Entry | None, Reason | None]:
        """BeginLoad(r, k, n): allocate (evicting if the rule allows), LOADING, waiters = {r}.

        Returns the entry whose range the caller must now fill (a store read when
        ``from_store``, else the request's own insert), or None and the reason it failed.
        """
        existing = self._entries.get(item.key)
        transition(ABSENT if existing is None else existing.state, Step.BEGIN_LOAD)
        nbytes, align = item.nbytes, self._align
        if nbytes > self.capacity:
            return self._alloc_failed(rs, item, Reason.TOO_LARGE)
        if type(nbytes) is int and nbytes > 0:
            size = (nbytes + align - 1) & -align  # the allocator's rounding, with no calls
        else:
            size = self._allocator.rounded(nbytes)  # raises the allocator's error
        offset = self._allocate(item.key, size)
        if isinstance(offset, Reason):
            return self._alloc_failed(rs, item, offset)
        shape = self._shapes.get(item.shape)
        if shape is None:  # intern it; a full table starts afresh (MAX_SHAPES bounds it)
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[item.shape] = item.shape
        entry = Entry(item.key, shape, item.dtype, offset, size, waiters=frozenset({rs.request_id}))
        entry.filler = None if from_store else rs.request_id
        self._entries[item.key] = entry
        rs.waits.add(item.key)
        if not from_store:
            rs.reserved.add(item.key)
        self._counts["loads_started" if from_store else "reservations"] += 1
        if self._events is not None:
            self._emit("BeginLoad", rs.request_id, item.key, entry, outcome="OK")
        return entry, None

    def end_load(
        self, entry: Entry, outcome: TransferOutcome, failed_reason: Reason | None
    ) -> list[RequestState]:
        """EndLoad(k, outcome): READY with waiters pinned, or freed, or QUARANTINED.

        Returns the waiters, which the caller must wake.
        """
        if self._entries.get(entry.key) is not entry:
            raise InvariantError(f"EndLoad for {entry.key!r}, whose entry is gone")
        if outcome is TransferOutcome.OK and not entry.doomed:
            step = Step.END_LOAD_OK
        elif outcome is TransferOutcome.UNKNOWN:
            step = Step.END_LOAD_UNKNOWN
        else:
            step = Step.END_LOAD_DOOMED if entry.doomed else Step.END_LOAD_FAILED
        new_state = transition(entry.state, step)
        waiters = [self._requests[r] for r in sorted(entry.waiters)]
        if entry.filler is not None:
            self._requests[entry.filler].reserved.discard(entry.key)
            entry.filler = None
        else:  # a store read
            self._counts["loads_" + outcome.name.lower()] += 1
        entry.state = new_state
        for rs in waiters:
            rs.waits.discard(entry.key)
        entry.waiters = NOBODY
        if step is Step.END_LOAD_OK:
            for rs in waiters:
                self._add_holder(entry, rs.request_id)
                rs.holds[entry.key] = None
            if not entry.holders:
                self._make_evictable(entry)
        else:
            reason = {
                Step.END_LOAD_DOOMED: Reason.REMOVED,
                Step.END_LOAD_UNKNOWN: Reason.LOAD_UNKNOWN,
            }.get(step, failed_reason or Reason.LOAD_FAILED)
            for rs in waiters:
                rs.fallbacks[entry.key] = reason
                self._counts["fallback:" + reason.value] += 1
            entry.doomed = False
            if new_state is ABSENT:
                self._free(entry)
            else:
                self._quarantine[entry.key] = self._clock()
        if self._events is not None:
            self._emit("EndLoad", None, entry.key, entry, outcome=outcome.name)
        return waiters

    def release(self, rs: RequestState, key: str) -> None:
        """Release(r, k) of one key (``release_all`` of one)."""
        self.release_all(rs, (key,))

    def release_all(self, rs: RequestState, keys: Iterable[str]) -> None:
        """Release(r, k) of each key in order: drop r's wait or pin; the last pin quarantines
        (a publish ended UNKNOWN), frees (doomed) or idles the entry. O(len(keys)).

        The one body of ``Release``, traced or not: the event is its tail. Holders are
        READY entries only, so a plain pin needs no table lookup unless the state is not
        READY (then ``transition`` raises, as the table says)."""
        entries, r, events = self._entries, rs.request_id, self._events
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
                    self._drop_pin(entry, r, Step.RELEASE_PIN)
                else:  # the last pin of a plain entry: it joins the eviction order
                    entry.holders = NOBODY
                    del self._pinned_since[key]
                    self._order.add(key)
                    self._evictable_bytes += entry.size
            if events is not None:
                self._emit("Release", r, key, entry)
        if not self._pinned_since:  # a dict keeps the table of its largest burst: start afresh
            self._pinned_since = {}

    def evict(self, entry: Entry, *, keep_range: bool = False) -> None:
        """Evict(k): free an idle READY entry chosen by the eviction rule. ``keep_range``: its
        range stays allocated, for the caller to give at once to the entry it evicted for."""
        if entry.pins or entry.doomed or entry.key not in self._order:
            raise InvariantError(f"eviction of {entry.key!r}, which is not evictable")
        entry.state = transition(entry.state, Step.EVICT)
        self._free(entry, keep_range)
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += entry.size
        if self._events is not None:
            self._emit("Evict", None, entry.key, entry)

    def remove(self, key: str) -> bool:
        """Remove(k): free now if idle, else doom; QUARANTINED entries wait for a fence."""
        entry = self._entries.get(key)
        if entry is None or entry.doomed or entry.state is QUARANTINED:
            return False
        if entry.state is READY and not entry.pins:
            entry.state = transition(entry.state, Step.REMOVE_IDLE)
            self._free(entry)
        else:
            transition(entry.state, Step.REMOVE_BUSY)
            entry.doomed = True
        self._emit("Remove", None, key, entry)
        return True

    def publish(self, rs: RequestState, key: str) -> Entry | None:
        """Publish(r, k): a write of k's range to the store starts under its own pin.

        Returns the entry whose range the caller must now write, or None when ``rs`` does not
        hold a READY entry for ``key`` or a publish of it is already running.
        """
        entry = self._entries.get(key)
        if entry is None or key not in rs.holds or entry.publishing or entry.state is not READY:
            return None
        transition(entry.state, Step.PUBLISH)
        entry.publishing = True
        self._add_holder(entry, ("publish", rs.request_id))
        self._counts["publishes_started"] += 1
        self._emit("Publish", rs.request_id, key, entry)
        return entry

    def end_publish(self, request_id: str, entry: Entry, outcome: TransferOutcome) -> None:
        """EndPublish(r, k, outcome): drop the publish pin; UNKNOWN taints the entry."""
        entry.publishing = False
        if outcome is TransferOutcome.UNKNOWN:
            entry.tainted = True
        self._counts["publishes_" + outcome.name.lower()] += 1
        self._drop_pin(entry, ("publish", request_id), Step.END_PUBLISH)
        self._emit("EndPublish", request_id, entry.key, entry, outcome=outcome.name)

    def begin_fence(self) -> FenceSnapshot:
        """BeginFence(f): the QUARANTINED entries now, taken just before the store's fence
        begins (that fence stops their transfers, not later ones). O(q)."""
        self._fences_begun += 1
        entries = self._entries
        snap = FenceSnapshot(self._fences_begun, tuple(entries[key] for key in self._quarantine))
        self._fencing[snap.fence] = snap.entries
        self._emit("BeginFence", None, fence=snap.fence, keys=[e.key for e in snap.entries])
        return snap

    def fence(self, snap: FenceSnapshot) -> int:
        """Fence(f): the store's fence ``snap.fence`` returned: free the entries of ``snap``
        that are still those very entries. Fences may overlap: a key another fence freed and
        that was QUARANTINED again since (by a transfer this fence does not cover) stays."""
        self._fencing.pop(snap.fence, None)
        freed = []
        for entry in snap.entries:
            if self._entries.get(entry.key) is entry:
                entry.state = transition(entry.state, Step.FENCE)
                self._free(entry)
                freed.append(entry.key)
        self._counts["fences"] += 1
        self._emit("Fence", None, None, None, fence=snap.fence, keys=freed)
        return len(freed)

    def abandon_fence(self, snap: FenceSnapshot) -> None:
        """The store's fence ``snap.fence`` failed: it ends, freeing nothing (QUARANTINED stay)."""
        self._fencing.pop(snap.fence, None)

    # ------------------------------------------------------------------ helpers of the actions
    def _alloc_failed(
        self, rs: RequestState, item: ItemLike, reason: Reason
    ) -> tuple[None, Reason]:
        self._counts["alloc_fail:" + reason.value] += 1
        self._emit(
            "BeginLoad", rs.request_id, item.key, None, outcome=reason.name, size=item.nbytes
        )
        return None, reason

    def _allocate(self, key: str, size: int) -> int | Reason:
        """A range of ``size`` bytes for ``key``, evicting the victims the rule chooses if
        the policy admits ``key`` at their cost; else why not (nothing evicted)."""
        allocator = self._allocator
        free = allocator.free_bytes
        if free >= size and (offset := allocator.allocate(size)) is not None:
            return offset  # (a full pool skips the search for a block that cannot exist)
        if not self._enable_eviction or free + self._evictable_bytes < size:
            return Reason.NO_SPACE
        if (head := next(iter(self._order), None)) is None:
            return Reason.NO_SPACE  # (what the search says of no candidates)
        first = self._entries[head]
        start, stop = allocator.free_around(first.offset, first.offset + first.size)
        victims = [first]  # the search's first step, without the search: it alone fits
        if stop - start < size:
            examined: list[Entry] = []  # the candidates looked at, in eviction order
            search = VictimSearch.over(size, self._max_batch, allocator)
            entries = self._entries
            window: Window | None = None
            for candidate in self._order:
                entry = entries[candidate]
                examined.append(entry)
                window = search.add(entry.offset, entry.size)
                if window is not None:
                    break
            if window is None:
                return Reason.NO_SPACE
            victims = [_examined_at(examined, offset) for offset in window.victims]
            start = window.offset
        if not self._policy.admit(key, size, [victim.key for victim in victims]):
            return Reason.NOT_ADMITTED
        # One victim of exactly ``size`` with no free block before it: freeing its range and
        # allocating ``size`` would give that very range back and leave the allocator as it
        # was (no other free block fits, or the allocation above would have succeeded), so the
        # range passes to the new entry without either call.
        same = len(victims) == 1 and victims[0].size == size and victims[0].offset == start
        for victim in victims:
            self.evict(victim, keep_range=same)
        if same:
            return start
        offset = allocator.allocate(size)
        if offset != start:
            raise InvariantError(f"eviction freed a span at {start}; the allocator gave {offset}")
        return start

    def _drop_pin(self, entry: Entry, holder: Holder, plain: Step) -> None:
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
        del self._pinned_since[entry.key]
        if not self._pinned_since:  # a dict keeps the table of its largest burst: start afresh
            self._pinned_since = {}
        if plain is Step.RELEASE_LAST_DOOMED:
            self._free(entry)
        elif plain is Step.RELEASE_LAST_TAINTED:
            entry.tainted = entry.doomed = False
            self._quarantine[entry.key] = self._clock()
        else:
            self._make_evictable(entry)

    def _add_holder(self, entry: Entry, holder: Holder) -> None:
        if entry.holders:
            entry.holders |= {holder}
            return
        entry.holders = frozenset((holder,))
        self._pinned_since[entry.key] = self._clock()
        if self._order.discard(entry.key):
            self._evictable_bytes -= entry.size

    def _make_evictable(self, entry: Entry) -> None:
        self._order.add(entry.key)
        self._evictable_bytes += entry.size

    def _free(self, entry: Entry, keep_range: bool = False) -> None:
        if not keep_range:
            self._allocator.free(entry.offset)
        del self._entries[entry.key]
        if self._order.discard(entry.key):
            self._evictable_bytes -= entry.size
        elif self._quarantine:
            self._quarantine.pop(entry.key, None)
        self._policy.forget(entry.key)
        entry.state = ABSENT
        if self._freed is not None:
            self._freed.append((entry.offset, entry.size))

    def _emit(
        self,
        action: str,
        request: str | None,
        key: str | None = None,
        entry: Entry | None = None,
        outcome: str | None = None,
        **extra: Any,
    ) -> None:
        events = self._events
        if events is None:
            return
        self._seq += 1
        event: dict[str, Any] = {
            "seq": self._seq,
            "action": action,
            "request": request,
            "key": key,
            "outcome": outcome,
        }
        if entry is not None:
            event.update(
                size=entry.size,
                offset=entry.offset,
                state=entry.state.name,
                holders=sorted(
                    h if isinstance(h, str) else "publish:" + h[1] for h in entry.holders
                ),
                waiters=sorted(entry.waiters),
                doomed=entry.doomed,
                tainted=entry.tainted,
            )
        event.update(extra)
        events.append(event)


def _examined_at(examined: list[Entry], offset: int) -> Entry:
    """The candidate at ``offset``, searched from the newest: a window holds the newest
    candidate and at most ``max_batch`` victims, so a scan of plain int comparisons costs less
    than a dict keyed by offset filled for every candidate (one int object each)."""
    for index in range(len(examined) - 1, -1, -1):
        entry = examined[index]
        if entry.offset == offset:
            return entry
    raise InvariantError(f"the victim search chose {offset}, which it was not offered")

