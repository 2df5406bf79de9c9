"""``CacheCore``: the request protocol over the core's one state.

Theory of operation (after h11's ``Connection``, which owns its state machine and exposes only
what a caller may do). ``CacheCore`` builds one ``embcache.core.state.CoreState`` and keeps it
private; its steps hand it to the action functions, grouped by responsibility
(``embcache.core.request_bodies``, ``embcache.core.entry_actions``,
``embcache.core.publishing``); a driver reads it through ``queries``
(``embcache.core.queries.StateQueries``), which changes nothing. A step checks first, runs
DESIGN actions underneath (so the trace and the spec correspondence are the actions') and
returns ONE ``Effects`` record (``embcache.core.effects``): its result, the loads and writes to
start, the requests to wake, the ranges freed, the trace events. The driver's step runner
(``embcache.driver.runner.StepRunner``) takes its lock, calls one step, carries out the record,
and does no I/O until the lock is released. A step raises changing nothing: ``ClosedError`` for
a closed request or cache (steps that start something; the ends of transfers in flight always
run). Every flag of a step is keyword-only.

The steps, few per request (embcache/DESIGN.md, "One owner, few steps"): ``begin_lookup``
(opens the request when given an id, reserves misses, hands back what the request may read)
and, only when it names keys to ask the store about, ``finish_lookup``; ``begin_insert`` (only
for keys the lookup did not reserve) and ``end_inserts`` (the one path that ends an insert's, a
batch's and an in-place fill's loads, publishes, and closes a batch's internal request);
``end_loads``; ``publish`` / ``end_publishes``; ``end_request``; ``remove``; ``begin_fence`` /
``end_fence``; ``start``, ``open_request`` and ``close``. An all-hit request is two steps
(``begin_lookup``, ``end_request``), one with misses three (``begin_lookup`` with reserve,
``end_inserts``, ``end_request``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from embcache.core import entry_actions, publishing, request_bodies
from embcache.core.effects import Effects, Fill, Looked, writes_of
from embcache.core.entries import Entry, FenceSnapshot, ItemLike, RequestState
from embcache.core.lookup_flags import LookupFlags
from embcache.core.outcomes import TransferOutcome
from embcache.core.policy import Policy
from embcache.core.queries import StateQueries
from embcache.core.state import CoreState
from embcache.errors import ClosedError, RequestError

T = TypeVar("T")


class CacheCore:
    """The cache's state machine: request steps and read-only ``queries``. Not thread-safe."""

    def __init__(
        self, capacity: int, alignment: int, max_eviction_batch: int, *,
        enable_eviction: bool = True, trace: bool = False, clock: Callable[[], float] = float,
        policy: Policy | None = None, record_freed: bool = False,
    ) -> None:  # fmt: skip
        self._state = CoreState(
            capacity, alignment, max_eviction_batch, enable_eviction,
            trace=trace, clock=clock, policy=policy, record_freed=record_freed,
        )  # fmt: skip
        self._queries = StateQueries(self._state)
        self._open = self._state.requests  # the open requests (read here, changed by actions)
        self._buffered = trace or record_freed  # whether a step has events or ranges to hand
        self._closed = False

    @property
    def queries(self) -> StateQueries:
        """The state's read-only view (``entries``, ``stats``, ``check_invariants``...)."""
        return self._queries

    # ------------------------------------------------------------------ request steps
    def start(self) -> Effects[None]:
        """The first step: hands the driver the Init event (when tracing)."""
        return self._done(Effects(None))

    def open_request(self, request_id: str) -> Effects[RequestState]:
        """OpenRequest(r). Raises ``ClosedError`` (cache closed) or ``RequestError`` (the id is
        taken), changing nothing."""
        if self._closed or request_id in self._open:
            self._check_new(request_id)
        fx = Effects(request_bodies.open_request(self._state, request_id))
        return self._taken(fx) if self._buffered else fx  # (``_done``, inlined: a hot step)

    def begin_lookup(
        self, request: RequestState | str, items: Sequence[ItemLike], flags: LookupFlags
    ) -> Effects[Looked]:
        """Lookup every item of ``request`` (an id: OpenRequest first, raising
        ``RequestError`` if it is open, as ``open_request``). A miss larger than the pool is
        TOO_LARGE. When misses remain and the store is to be asked (``flags.ask_store``), the
        result names their keys: call ``finish_lookup`` next. Else the lookup is over: misses
        reserved when ``flags.reserve`` (the result's fills), and, when ``flags.serve`` and
        nothing is pending, what the request may read. The flags are one shared object of
        ``embcache.core.lookup_flags.LOOKUP_FLAGS``. O(len(items))."""
        ask_store, reserve, serve = flags.ask_store, flags.reserve, flags.serve
        st = self._state
        if isinstance(request, RequestState):
            rs = request
            if self._closed or self._open.get(rs.request_id) is not rs:
                self._check(rs)
            looked = request_bodies.lookup_request(st, rs, items, ask_store, reserve, serve)
        else:
            if self._closed or request in self._open:
                self._check_new(request)
            rs = request_bodies.open_request(st, request)
            try:
                looked = request_bodies.lookup_request(st, rs, items, ask_store, reserve, serve)
            except BaseException:
                request_bodies.end_request(st, rs)  # opened here: nobody else could close it
                raise
        fx = Effects(looked)
        if not looked.ask:
            fx.waiting = rs
        return self._taken(fx) if self._buffered else fx  # (``_done``, inlined: a hot step)

    def finish_lookup(
        self, rs: RequestState, *, found: Mapping[str, bool] | None, serve: bool
    ) -> Effects[Looked]:
        """End ``rs``'s lookup: its second pass, when ``begin_lookup`` named keys to ask the
        store about and the store said which it holds (``found``; None: the store failed):
        join what others started meanwhile, else start a store read or a reservation (the
        final statuses; the loads to start). Then, when ``serve``, what ``rs`` may read now
        (``final`` once nothing is pending): also the step that serves a request after a
        wait, with no second pass pending (``found`` unused, no statuses)."""
        self._check(rs)
        st = self._state
        loads: list[Entry] = []
        fills: list[Fill] = []
        statuses = request_bodies.finish_lookup(st, rs, found, loads, fills)
        served = request_bodies.served(st, rs) if serve else None
        fx = Effects(Looked(rs, statuses, [], served, fills))
        fx.loads, fx.waiting = loads, rs
        return self._done(fx)

    def begin_insert(
        self, items: Sequence[ItemLike], *, request: RequestState | None, hand_out: bool
    ) -> Effects[tuple[RequestState, list[Fill]]]:
        """The LOADING entries ``request`` must now fill for ``items``, each with its item's
        index: its reservations, and a BeginLoad for each absent key (a duplicate key once). None: a
        request-less insert, for an internal request opened here (``insert#N``), which
        ``end_inserts(..., close=True)`` ends. ``hand_out``: the ranges go to a writer
        outside the driver, until ``end_inserts(..., handed_out=True)`` or ``end_request``.
        Raises (changing nothing) when a reserved key's shape or dtype differs from the
        reservation."""
        st = self._state
        if request is None:
            self._check_open()
            rs = request_bodies.open_request(st, request_bodies.next_batch_id(st, "insert"))
        else:
            rs = request
            if self._closed or self._open.get(rs.request_id) is not rs:
                self._check(rs)
        fx = Effects((rs, request_bodies.plan_fills(st, rs, items, hand_out=hand_out)))
        return self._taken(fx) if self._buffered else fx  # (``_done``, inlined: a hot step)

    def end_inserts(
        self, rs: RequestState, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome], *,
        count: int, publish: bool, close: bool = False, handed_out: bool = False,
        check: bool = False, work: Sequence[tuple[str, float, int]] | None = None,
    ) -> Effects[list[bool]]:  # fmt: skip
        """The one path that ends fills: EndLoad each of ``rs``'s fills with its writer's
        outcome (a copy's, whatever became of the cache or the request meanwhile: a load in
        flight must end; ``handed_out``: an outside writer's, only for ranges handed out, and
        only while ``rs`` is open). Which of ``count`` items are cached now, the requests to
        wake, the writes of the cached ones (``publish``); ``close``: ``end_request`` after.
        ``check`` (an insert into the ranges a lookup reserved, which no step checked before
        the copy): raise ``ClosedError`` unless the cache and ``rs`` are open, changing
        nothing. ``work``: ``(key, seconds, nbytes)`` of each output encoded (checked by the
        caller), for a policy that keeps work (``WorkPolicy``); None: unknown."""
        st = self._state
        if handed_out or check:
            self._check(rs)
        results, wake = request_bodies.end_fills(
            st, rs, fills, outcomes, count=count, handed_out=handed_out, work=work
        )
        writes = None
        if publish:
            cached = [entry.key for i, entry in fills if results[i]]
            writes = writes_of(rs, publishing.publish_keys(st, rs, cached))
        if close:
            wake += request_bodies.end_request(st, rs)
        fx = Effects(results)
        fx.writes, fx.wake = writes, wake
        return self._taken(fx) if self._buffered else fx  # (``_done``, inlined: a hot step)

    def end_loads(
        self, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]
    ) -> Effects[None]:
        """EndLoad each store read with its outcome; the requests to wake."""
        st = self._state
        wake: list[RequestState] = []
        for entry, outcome in zip(entries, outcomes, strict=True):
            wake += entry_actions.end_load(st, entry, outcome, None)
        fx = Effects(None)
        fx.wake = wake
        return self._done(fx)

    def publish(
        self, keys: Sequence[str], *, request: RequestState | None, store: bool,
        entries: Sequence[Entry] = (),
    ) -> Effects[list[bool]]:  # fmt: skip
        """Publish each key ``request`` holds READY (with a ``store`` only); per key whether a
        write started; the writes to start. ``request`` None: publish again (failed publishes
        retried, ``embcache.driver.backlog``) ``entries``, one per key: the very entries that
        failed, under an internal request ``republish#N`` that pins each still its key's,
        READY, not doomed, tainted or being published (Lookup, not counted as a hit),
        publishes it and closes in this step; an entry evicted, removed or quarantined since
        is not written, even if its key was cached anew (that entry is not the one that
        failed)."""
        st = self._state
        wake: list[RequestState] = []
        if request is None:
            self._check_open()
            rs, started, wake = publishing.republish(st, keys, entries)
        else:
            rs = request
            self._check(rs)
            started = publishing.publish_keys(st, rs, keys) if store else [None] * len(keys)
        fx = Effects([e is not None for e in started])
        fx.writes, fx.wake = writes_of(rs, started), wake
        return self._done(fx)

    def end_publishes(
        self, request_id: str, entries: Sequence[Entry], outcomes: Sequence[TransferOutcome]
    ) -> Effects[None]:
        """EndPublish each write with its outcome."""
        st = self._state
        for entry, outcome in zip(entries, outcomes, strict=True):
            publishing.end_publish(st, request_id, entry, outcome)
        return self._done(Effects(None))

    def end_request(self, rs: RequestState) -> Effects[None]:
        """End every reservation of ``rs`` (its waiters fall back; a range still handed out
        to a writer ends UNKNOWN: quarantined), release every wait and pin in lookup order, then
        CloseRequest; the requests to wake. A request already closed: nothing. Idempotent."""
        if self._open.get(rs.request_id) is not rs:
            return self._done(Effects(None))
        fx = Effects(None)
        fx.wake, fx.closed = request_bodies.end_request(self._state, rs), rs
        return self._taken(fx) if self._buffered else fx  # (``_done``, inlined: a hot step)

    def remove(self, *, key: str | None) -> Effects[int]:
        """Remove(k): freed now if idle, doomed if busy; 0 when absent (or already so), else
        1. None: Remove every entry; how many were removed or doomed."""
        self._check_open()
        st = self._state
        if key is not None:
            return self._done(Effects(int(entry_actions.remove(st, key))))
        return self._done(Effects(sum(entry_actions.remove(st, k) for k in list(st.entries))))

    def begin_fence(self, begun: list[FenceSnapshot]) -> Effects[FenceSnapshot]:
        """BeginFence(f): the snapshot to end with ``end_fence``, also appended to ``begun``
        (the driver keeps it even if carrying out the step raises)."""
        self._check_open()
        begun.append(publishing.begin_fence(self._state))
        return self._done(Effects(begun[-1]))

    def end_fence(self, snap: FenceSnapshot, *, ok: bool) -> Effects[int]:
        """Fence(f) after the store's fence returned (``ok``); how many entries it freed. Not
        ``ok`` (the store's fence failed): the fence ends, freeing nothing."""
        if not ok:
            publishing.abandon_fence(self._state, snap)
            return self._done(Effects(0))
        return self._done(Effects(publishing.fence(self._state, snap)))

    def close(self) -> Effects[bool]:
        """Take no new requests or inserts any more (transfers in flight still end); whether
        it was open."""
        was_open, self._closed = not self._closed, True
        return self._done(Effects(was_open))

    # ------------------------------------------------------------------ helpers
    def _done(self, fx: Effects[T]) -> Effects[T]:
        """The step's record, with the events and freed ranges its actions buffered."""
        return self._taken(fx) if self._buffered else fx

    def _taken(self, fx: Effects[T]) -> Effects[T]:
        fx.events, fx.freed = self._state.take_events(), self._state.take_freed()
        return fx

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed: create a new EmbeddingCache")

    def _check(self, rs: RequestState) -> None:
        """Raise ``ClosedError`` unless the cache and ``rs`` are open."""
        if self._closed or self._open.get(rs.request_id) is not rs:
            self._check_open()
            raise ClosedError(f"request {rs.request_id!r} is closed")

    def _check_new(self, request_id: str) -> None:
        self._check_open()
        if request_id in self._open:
            raise RequestError(f"request {request_id!r} is already open: ids must be unique")
