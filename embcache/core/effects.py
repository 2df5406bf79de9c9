"""What a request step of ``CacheCore`` tells its driver to do next: one record per step.

Every step returns one ``Effects``: its ``result`` (what the caller asked for) and everything
the driver must now carry out, in one place (``EmbeddingCache._run``): poison the ``freed``
ranges (debug mode, before the lock goes), arm or drop wake-ups (``waiting``, ``closed``) and
wake the ``wake`` requests (under the lock), then, with no lock held, deliver the trace
``events``, start the store reads (``loads``) and writes (``writes``) on the I/O pool. Each
transfer reports its outcome back through a later step (``end_loads``, ``end_publishes``).
Fields with nothing to do are shared empty tuples: a step that only answers allocates no list.
A slotted class, not a named tuple: the driver reads every field of every step, and a slot is
read in one specialized instruction where a named tuple's field goes through its descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from embcache.core.entries import Entry, RequestState
from embcache.core.outcomes import ItemStatus

T = TypeVar("T")


class Writes(NamedTuple):
    """Store writes (publishes) to start for request ``request_id``: each entry's range."""

    request_id: str
    entries: list[Entry]


class Effects(Generic[T]):
    """One step's answer and what the driver must do about it (see the module docstring).

    Made with the result (and, in cold steps, keywords); a hot step sets the other fields
    after (a keyword costs a dict per call, a slot store next to nothing)."""

    __slots__ = ("closed", "events", "freed", "loads", "result", "waiting", "wake", "writes")

    def __init__(
        self,
        result: T,
        loads: Sequence[Entry] = (),
        writes: Writes | None = None,
        wake: Sequence[RequestState] = (),
        waiting: RequestState | None = None,
        closed: RequestState | None = None,
    ) -> None:
        self.result = result
        self.loads = loads  # store reads to start (then ``end_loads``)
        self.writes = writes  # store writes to start (then ``end_publishes``)
        self.wake = wake  # requests whose wait may have ended
        self.waiting = waiting  # a request whose lookup ended: arm its wake-up
        self.closed = closed  # a request that closed: wake and drop its wake-up
        self.freed: Sequence[tuple[int, int]] = ()  # ranges freed (``record_freed``)
        self.events: Sequence[dict[str, Any]] = ()  # trace events, in ``seq`` order


class LookupStart(NamedTuple):
    """``begin_lookup``'s result: a status per item, and the keys to ask the store about
    (sorted; empty: the lookup is over, else call ``finish_lookup`` with the answer)."""

    statuses: list[ItemStatus]
    ask: list[str]


class Fill(NamedTuple):
    """One range an insert must fill: ``items[item]``'s bytes into ``entry``'s range."""

    item: int
    entry: Entry


def writes_of(rs: RequestState, started: Sequence[Entry | None]) -> Writes | None:
    """The writes to start for ``rs``: the publishes that started, None if none did."""
    entries = [entry for entry in started if entry is not None]
    return Writes(rs.request_id, entries) if entries else None
