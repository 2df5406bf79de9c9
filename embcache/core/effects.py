"""What a request step of ``CacheCore`` tells its driver to do next: one record per step.

Every step returns one ``Effects``: its ``result`` (what the caller asked for) and everything
the driver must now carry out, in one place (``embcache.driver.runner.StepRunner.run``): poison
the ``freed`` ranges (debug mode, before the lock goes), arm or drop wake-ups (``waiting``,
``closed``) and wake the ``wake`` requests (under the lock), then, with no lock held, deliver
the trace ``events``, start the store reads (``loads``) and writes (``writes``) on the I/O
pool. Each transfer reports its outcome back through a later step (``end_loads``,
``end_publishes``).
Fields with nothing to do are shared empty tuples: a step that only answers allocates no list.
A slotted class, not a named tuple: the driver reads every field of every step, and a slot is
read in one specialized instruction where a named tuple's field goes through its descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from embcache.core.entries import Entry, ItemLike, RequestState
from embcache.core.outcomes import ItemStatus, Reason

T = TypeVar("T")


class Writes(NamedTuple):
    """Store writes (publishes) to start for request ``request_id``: each entry's range."""

    request_id: str
    entries: list[Entry]


class Effects(Generic[T]):
    """One step's answer and what the driver must do about it (see the module docstring).

    Made with the result alone; a step sets the fields it has something for after (a slot
    store costs next to nothing; keywords would cost a dict per call)."""

    __slots__ = ("closed", "events", "freed", "loads", "result", "waiting", "wake", "writes")

    def __init__(self, result: T) -> None:
        self.result = result
        self.loads: Sequence[Entry] = ()  # store reads to start (then ``end_loads``)
        self.writes: Writes | None = None  # store writes to start (then ``end_publishes``)
        self.wake: Sequence[RequestState] = ()  # requests whose wait may have ended
        self.waiting: RequestState | None = None  # a request whose lookup ended: arm its wake-up
        self.closed: RequestState | None = None  # a request that closed: wake and drop it
        self.freed: Sequence[tuple[int, int]] = ()  # ranges freed (``record_freed``)
        self.events: Sequence[dict[str, Any]] = ()  # trace events, in ``seq`` order

    def busy(self) -> bool:
        """Whether the driver has more to carry out than the result while no request has a
        wake-up: ranges to poison, requests to wake, events, transfers, or a waiting request
        with a load pending (``closed``, and ``waiting`` with none pending, touch only
        wake-ups). One call, not a field read each: this runs after every step."""
        waiting = self.waiting
        return bool(
            self.freed or self.wake or self.events or self.loads or self.writes is not None
            or (waiting is not None and waiting.waits and waiting.pending())
        )  # fmt: skip


# One range an insert must fill, ``(i, entry)``: ``items[i]``'s bytes into ``entry``'s range.
# A plain pair, not a named tuple: a request makes one per miss, and a named tuple's
# constructor is a Python call.
Fill = tuple[int, Entry]


class Served(NamedTuple):
    """What a request may read, derived from its state (``request_bodies.served``): per
    looked-up item the range it may read (offset and item) or None, and why each unserved one
    falls back (None for the served). ``final``: nothing pending, so only a later step of the
    request itself changes it (a driver may keep it until then)."""

    ranges: list[tuple[int, ItemLike] | None]
    reasons: list[Reason | None]
    final: bool


class Looked(NamedTuple):
    """``begin_lookup``'s and ``finish_lookup``'s result: the request (opened by the step when
    it was given an id), a status per item, the keys to ask the store about (sorted; empty:
    the lookup is over, else call ``finish_lookup`` with the answer), what the request may
    read once the lookup is over (when asked for: ``serve``), and the reservations it made
    (each item's index and LOADING entry, for the insert that fills them)."""

    request: RequestState
    statuses: list[ItemStatus]
    ask: list[str]
    served: Served | None
    fills: list[Fill]


def writes_of(rs: RequestState, started: Sequence[Entry | None]) -> Writes | None:
    """The writes to start for ``rs``: the publishes that started, None if none did."""
    entries = [entry for entry in started if entry is not None]
    return Writes(rs.request_id, entries) if entries else None
