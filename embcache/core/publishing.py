"""Publishes and fences: the DESIGN actions that write a range to the global store under a pin
(``publish``, ``end_publish``), publish again what failed (``republish``), and free the
quarantine once the store is fenced (``begin_fence``, ``fence``, ``abandon_fence``).

Each is a function of the state it changes (``embcache.core.state.CoreState``), named as in
the spec; each checks the transition table before it changes anything and buffers its trace
event. Pure and not thread-safe: the driver locks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from embcache.core.entries import Entry, FenceSnapshot, RequestState
from embcache.core.entry_actions import add_holder, drop_pin, free
from embcache.core.lifecycle import READY, Step, transition
from embcache.core.outcomes import TransferOutcome
from embcache.core.request_bodies import end_request, lookup_all, next_batch_id, open_request
from embcache.core.state import CoreState


class _Again(NamedTuple):
    """The item of an entry looked up again to publish it again (``republish``)."""

    key: str
    shape: tuple[int, ...]
    dtype: Hashable
    nbytes: int


def publish(st: CoreState, rs: RequestState, key: str) -> Entry | None:
    """Publish(r, k): a write of k's range to the store starts under its own pin. The entry
    whose range the caller must now write, or None when ``rs`` does not hold a READY entry for
    ``key`` or a publish of it is already running."""
    entry = st.entries.get(key)
    if entry is None or key not in rs.holds or entry.publishing or entry.state is not READY:
        return None
    transition(entry.state, Step.PUBLISH)
    entry.publishing = True
    add_holder(st, entry, ("publish", rs.request_id))
    st.counts["publishes_started"] += 1
    st.emit("Publish", rs.request_id, key, entry)
    return entry


def publish_keys(st: CoreState, rs: RequestState, keys: Sequence[str]) -> list[Entry | None]:
    """Publish(r, k) of each key: per key the entry whose range to write, or None."""
    return [publish(st, rs, key) for key in keys]


def end_publish(st: CoreState, request_id: str, entry: Entry, outcome: TransferOutcome) -> None:
    """EndPublish(r, k, outcome): drop the publish pin; UNKNOWN taints the entry."""
    entry.publishing = False
    if outcome is TransferOutcome.UNKNOWN:
        entry.tainted = True
    st.counts["publishes_" + outcome.name.lower()] += 1
    drop_pin(st, entry, ("publish", request_id), Step.END_PUBLISH)
    st.emit("EndPublish", request_id, entry.key, entry, outcome=outcome.name)


def republish(
    st: CoreState, keys: Sequence[str], entries: Sequence[Entry]
) -> tuple[RequestState, list[Entry | None], list[RequestState]]:
    """Publish again each key whose entry is still the one given for it in ``entries`` (not
    freed, even if the key was cached anew since), READY and not doomed, tainted or being
    published, under a new internal request that pins it (Lookup; a republish is no request's
    hit), publishes it (Publish: the write holds its own pin) and closes. The request, per key
    the entry to write or None, the requests to wake."""
    rs = open_request(st, next_batch_id(st, "republish"))
    live: dict[str, Entry] = {}  # a key twice: written once
    for key, entry in zip(keys, entries, strict=True):
        if (
            st.entries.get(key) is entry
            and entry.state is READY
            and not (entry.doomed or entry.tainted or entry.publishing)
        ):
            live[key] = entry
    if live:
        again = [_Again(e.key, e.shape, e.dtype, e.size) for e in live.values()]
        _, missed = lookup_all(st, rs, again)
        assert not missed, "a live READY entry is a hit"
        st.counts["hits"] -= len(live)
    started = dict(zip(live, publish_keys(st, rs, list(live)), strict=True))
    wake = end_request(st, rs)
    return rs, [started.pop(key, None) for key in keys], wake


def begin_fence(st: CoreState) -> FenceSnapshot:
    """BeginFence(f): the QUARANTINED entries now, taken just before the store's fence begins
    (that fence stops their transfers, not later ones). O(q)."""
    st.fences_begun += 1
    entries = st.entries
    snap = FenceSnapshot(st.fences_begun, tuple(entries[key] for key in st.quarantine))
    st.fencing[snap.fence] = snap.entries
    st.emit("BeginFence", None, fence=snap.fence, keys=[e.key for e in snap.entries])
    return snap


def fence(st: CoreState, snap: FenceSnapshot) -> int:
    """Fence(f): the store's fence ``snap.fence`` returned: free the entries of ``snap`` that
    are still those very entries; how many. Fences may overlap: a key another fence freed and
    that was QUARANTINED again since (by a transfer this fence does not cover) stays."""
    st.fencing.pop(snap.fence, None)
    freed = []
    for entry in snap.entries:
        if st.entries.get(entry.key) is entry:
            entry.state = transition(entry.state, Step.FENCE)
            free(st, entry)
            freed.append(entry.key)
    st.counts["fences"] += 1
    st.emit("Fence", None, None, None, fence=snap.fence, keys=freed)
    return len(freed)


def abandon_fence(st: CoreState, snap: FenceSnapshot) -> None:
    """The store's fence ``snap.fence`` failed: it ends, freeing nothing (QUARANTINED stay)."""
    st.fencing.pop(snap.fence, None)
