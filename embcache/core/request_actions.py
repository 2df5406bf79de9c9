"""A request's bodies over the core's one state: lookups in two passes, inserts and in-place
fills, what a request may read, and its end; all over the DESIGN actions of ``Actions``.

Theory of operation. ``RequestActions`` is ``Actions`` (the entry-level DESIGN actions and the
state they change) plus the request-level compositions a step of ``CacheCore`` runs. One object
owns the state: ``CacheCore`` holds one ``RequestActions`` and reads no field of it. A request's
bookkeeping (``RequestState``: what it holds, waits for, fills and falls back on) changes only
here and in ``Actions``, through the named transitions of embcache/DESIGN.md ("Request
bookkeeping"): Pin, Join, Reserve, Load, HandOut, FallBack, Note, Ask, Release, Close.
``tests/test_structure.py`` checks that no other module changes a ``RequestState``.

What a request may read is derived, never stored: ``served`` computes it from its items and
holds (a ``Served`` record the driver keeps until its next step, since only a step of the
request itself changes it once nothing is pending).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

from embcache.core.actions import Actions
from embcache.core.effects import Fill, Looked, Served
from embcache.core.entries import Entry, ItemLike, RequestState, matches
from embcache.core.lifecycle import READY
from embcache.core.outcomes import (
    LOADING_STATUS,
    MISSES,
    RESERVED_STATUS,
    ItemStatus,
    Reason,
    TransferOutcome,
)
from embcache.core.policy import WorkPolicy
from embcache.errors import InvalidArgumentError

NOT_FOUND = Reason.NOT_FOUND
# A named tuple built without its Python-level ``__new__`` (a frame each): for the all-hit
# lookup, the hot path (``allocator._new_block`` does the same).
_NEW = tuple.__new__


class _Again(NamedTuple):
    """The item of an entry looked up again to publish it again (``RequestActions.republish``)."""

    key: str
    shape: tuple[int, ...]
    dtype: Hashable
    nbytes: int


class RequestActions(Actions):
    """The cache's state, its DESIGN actions and a request's bodies over them (one owner).
    Not thread-safe: the driver locks."""

    def next_batch_id(self, kind: str = "insert") -> str:
        """A free id for an internal request (``insert#N``, ``republish#N``)."""
        self._batches += 1
        request_id = f"{kind}#{self._batches}"
        while request_id in self._requests:  # a caller's own request took the name
            self._batches += 1
            request_id = f"{kind}#{self._batches}"
        return request_id

    # ------------------------------------------------------------------ lookups
    def lookup_request(
        self, rs: RequestState, items: Sequence[ItemLike], ask_store: bool, reserve: bool,
        serve: bool,
    ) -> Looked:  # fmt: skip
        """A lookup's first pass: Lookup each item (the policy records each key), then, when
        some item missed, TOO_LARGE for a miss larger than the pool and either the keys to
        ask the store about (Ask: ``finish_lookup`` ends the lookup) or the misses reserved
        (Reserve) and the lookup ended (Note, FallBack). Once it is over, and when ``serve``,
        what ``rs`` may read if nothing is pending."""
        record = self._record
        if record is not None:
            for item in items:
                record(item.key)
        first = not rs.items
        statuses, missed = self.lookup_all(rs, items)
        fills: list[Fill] = []
        if not missed:  # all hits: nothing to fall back on (Note)
            rs.items.extend(items)
            if serve and first:  # its only lookup: what it may read is the hits
                entries = self._entries
                ranges: list[tuple[int, ItemLike] | None]
                ranges = [(entries[it.key].offset, it) for it in items]
                hits = _NEW(Served, (ranges, [None] * len(items), True))
                return _NEW(Looked, (rs, statuses, [], hits, fills))
            return Looked(rs, statuses, [], self.served(rs) if serve else None, fills)
        capacity = self._allocator.capacity
        not_found = False
        for i, item in enumerate(items):
            if statuses[i].reason is NOT_FOUND:
                if item.nbytes > capacity:
                    statuses[i] = MISSES[Reason.TOO_LARGE]
                else:
                    not_found = True
        if not (not_found and (ask_store or reserve)):
            self._end_lookup(rs, items, statuses)
        elif not ask_store:
            statuses = self._start_misses(rs, items, statuses, {}, reserve, False, None, fills)
        else:
            rs.lookup_pending = (list(items), statuses, reserve)  # Ask
            pairs = zip(items, statuses, strict=True)
            ask = sorted({it.key for it, s in pairs if s.reason is NOT_FOUND})
            return Looked(rs, statuses, ask, None, fills)
        served = self.served(rs) if serve and not rs.pending() else None
        return Looked(rs, statuses, [], served, fills)

    def finish_lookup(
        self, rs: RequestState, found: Mapping[str, bool] | None, loads: list[Entry],
        fills: list[Fill] | None,
    ) -> list[ItemStatus]:  # fmt: skip
        """A lookup's second pass once the store said which asked keys it holds (``found``;
        None: the store failed): join what others started meanwhile, else start a store read
        (Load, appended to ``loads``) or a reservation (Reserve); the final statuses (none
        when no second pass is pending)."""
        pending = rs.lookup_pending
        if pending is None:  # no second pass pending: nothing to do
            return []
        rs.lookup_pending = None
        items, statuses, reserve = pending
        return self._start_misses(
            rs, items, statuses, found or {}, reserve, found is None, loads, fills
        )

    def served(self, rs: RequestState) -> Served:
        """Per looked-up item, the range it may read (offset and item) or None, and why each
        unserved one falls back. O(items)."""
        holds, entries = rs.holds, self._entries
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

    # ------------------------------------------------------------------ inserts and fills
    def plan_fills(self, rs: RequestState, items: Sequence[ItemLike], hand_out: bool) -> list[Fill]:
        """The LOADING entries ``rs`` must now fill, each with its item's index: its
        reservations, and a BeginLoad (Reserve) for each absent key (a duplicate key once);
        ``hand_out``: each is handed to an outside writer (HandOut). Raises (changing nothing)
        when a reserved key's shape or dtype differs from the reservation."""
        entries = self._entries
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
        begin_load = self.begin_load
        for i, item in enumerate(items):
            key = item.key
            if key in planned:
                continue  # a duplicate key is inserted once
            if key in rs.reserved:
                fills.append((i, entries[key]))
                planned.add(key)
            elif key not in entries:
                entry, _ = begin_load(rs, item, from_store=False)
                if entry is not None:
                    fills.append((i, entry))
                    planned.add(key)
        if hand_out:
            rs.filling.update(entry.key for _, entry in fills)  # HandOut
        return fills

    def end_fills(
        self, rs: RequestState, fills: Sequence[Fill], outcomes: Sequence[TransferOutcome],
        count: int, handed_out: bool, work: Sequence[tuple[str, float, int]] | None = None,
    ) -> tuple[list[bool], list[RequestState]]:  # fmt: skip
        """The one load-ending path of an insert, a request-less batch and an in-place fill:
        EndLoad each of ``rs``'s fills with its writer's outcome (OK: READY, pinned by its
        waiters). With ``handed_out``, a fill that is not (or no longer) handed out to a
        writer is left alone. ``work`` (checked by the caller; None: unknown): ``(key,
        seconds, nbytes)`` of each output encoded, told to a policy that keeps work
        (``WorkPolicy``) after the loads end: ``note_work`` where the key's entry is READY,
        else ``note_encoded``. Which of ``count`` items are cached now, and the requests to
        wake."""
        results = [False] * count
        wake: list[RequestState] = []
        end_load, entries, filling = self.end_load, self._entries, rs.filling
        for (i, entry), outcome in zip(fills, outcomes, strict=True):
            if handed_out:
                if entry.key not in filling or entries.get(entry.key) is not entry:
                    continue
                filling.discard(entry.key)  # (the fill ends: no longer handed out)
            wake += end_load(entry, outcome, Reason.LOAD_FAILED)
            results[i] = entry.state is READY
        self._counts["inserts"] += sum(results)
        if work is not None and self._work_policy is not None:
            self._note_work(self._work_policy, work)
        return results, wake

    def _note_work(self, policy: WorkPolicy, work: Sequence[tuple[str, float, int]]) -> None:
        """Tell ``policy`` each output's encoder seconds: cached (its entry READY) or not."""
        entries, align = self._entries, self._align
        for key, seconds, nbytes in work:
            entry = entries.get(key)
            if entry is not None and entry.state is READY:
                policy.note_work(key, seconds, entry.size)
            else:
                policy.note_encoded(key, seconds, max((nbytes + align - 1) & -align, align))

    def publish_keys(self, rs: RequestState, keys: Sequence[str]) -> list[Entry | None]:
        """Publish(r, k) of each key: per key the entry whose range to write, or None."""
        publish = self.publish
        return [publish(rs, key) for key in keys]

    def republish(
        self, keys: Sequence[str]
    ) -> tuple[RequestState, list[Entry | None], list[RequestState]]:
        """Publish again each key still READY and not doomed, tainted or being published,
        under a new internal request that pins it (Lookup; a republish is no request's hit),
        publishes it (Publish: the write holds its own pin) and closes. The request, per key
        the entry to write or None, the requests to wake."""
        rs = self.open_request(self.next_batch_id("republish"))
        entries = self._entries
        live: dict[str, Entry] = {}  # a key twice: written once
        for key in keys:
            entry = entries.get(key)
            if (
                entry is not None
                and entry.state is READY
                and not (entry.doomed or entry.tainted or entry.publishing)
            ):
                live[key] = entry
        if live:
            again = [_Again(e.key, e.shape, e.dtype, e.size) for e in live.values()]
            _, missed = self.lookup_all(rs, again)
            assert not missed, "a live READY entry is a hit"
            self._counts["hits"] -= len(live)
        started = dict(zip(live, self.publish_keys(rs, list(live)), strict=True))
        wake = self.end_request(rs)
        return rs, [started.pop(key, None) for key in keys], wake

    # ------------------------------------------------------------------ the end
    def end_request(self, rs: RequestState) -> list[RequestState]:
        """End every reservation of ``rs`` (its waiters fall back; a range still handed out
        ends UNKNOWN: quarantined), release every wait and pin in lookup order, then
        CloseRequest; the requests to wake."""
        rs.lookup_pending = None
        wake: list[RequestState] = []
        if rs.reserved:
            entries = self._entries
            for key in sorted(rs.reserved):
                outcome = TransferOutcome.UNKNOWN if key in rs.filling else TransferOutcome.FAILED
                wake += self.end_load(entries[key], outcome, Reason.ABANDONED)
            rs.filling.clear()
        if rs.waits:
            self.release_all(rs, sorted(rs.waits))
        self.release_all(rs, rs.release_order())
        self.close_request(rs)
        return wake

    # ------------------------------------------------------------------ helpers
    def _start_misses(
        self, rs: RequestState, items: Sequence[ItemLike], statuses: list[ItemStatus],
        found: Mapping[str, bool], reserve: bool, store_error: bool,
        loads: list[Entry] | None, fills: list[Fill] | None,
    ) -> list[ItemStatus]:  # fmt: skip
        """Second pass over the NOT_FOUND items: join what others started meanwhile, else
        BeginLoad a store read (appended to ``loads``) or a reservation (to ``fills``); then
        end the lookup."""
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
                    if fills is not None:
                        fills.append((i, entry))
            if statuses[i].reason is NOT_FOUND and store_error:
                statuses[i] = MISSES[Reason.STORE_ERROR]
        self._end_lookup(rs, items, statuses)
        return statuses

    def _end_lookup(
        self, rs: RequestState, items: Sequence[ItemLike], statuses: Sequence[ItemStatus]
    ) -> None:
        """Note the items and FallBack on each miss's reason; count the misses."""
        counts = self._counts
        for item, status in zip(items, statuses, strict=True):
            reason = status.reason
            if reason is not None:
                rs.fallbacks[item.key] = reason
                counts["miss:" + reason.value] += 1
        rs.items.extend(items)
