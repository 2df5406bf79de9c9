"""What a request step of ``CacheCore`` tells its driver to do next: one record per step.

Every step returns one ``Effects``: its ``result`` (what the caller asked for) and everything
the driver must now carry out, in one place (``EmbeddingCache._run``): poison the ``freed``
ranges (debug mode, before the lock goes), arm or drop wake-ups (``waiting``, ``closed``) and
wake the ``wake`` requests (under the lock), then, with no lock held, deliver the trace
``events``, start the store reads (``loads``) and writes (``writes``) on the I/O pool. Each
transfer reports its outcome back through a later step (``end_loads``, ``end_publishes``).
Fields with nothing to do are shared empty tuples: a step that only answers allocates no list.
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


class Effects(NamedTuple, Generic[T]):
    """One step's answer and what the driver must do about it (see the module docstring)."""

    result: T
    loads: Sequence[Entry] = ()  # store reads to start (then ``end_loads``)
    writes: Writes | None = None  # store writes to start (then ``end_publishes``)
    wake: Sequence[RequestState] = ()  # requests whose wait may have ended
    waiting: RequestState | None = None  # a request whose lookup ended: arm its wake-up
    closed: RequestState | None = None  # a request that closed: wake and drop its wake-up
    freed: Sequence[tuple[int, int]] = ()  # (offset, size) ranges freed (``record_freed``)
    events: Sequence[dict[str, Any]] = ()  # trace events, in ``seq`` order (when tracing)


class LookupStart(NamedTuple):
    """``begin_lookup``'s result: a status per item, and the keys to ask the store about
    (sorted; empty: the lookup is over, else call ``finish_lookup`` with the answer)."""

    statuses: list[ItemStatus]
    ask: list[str]


class Fill(NamedTuple):
    """One range an insert must fill: ``items[item]``'s bytes into ``entry``'s range."""

    item: int
    entry: Entry
