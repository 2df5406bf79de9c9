"""Execution traces: one event per action, in action order, as JSON lines.

Pass a ``TraceLog`` (or any ``TraceSink``: an object with ``append``) as
``EmbeddingCache(trace=...)``. The first event, ``Init``, records ``capacity``, ``alignment``,
``max_eviction_batch`` and ``enable_eviction``. Each later event is a dict with ``seq``,
``action`` (a DESIGN.md action name), ``request``, ``key``, ``outcome`` and, when the action
touched an entry, the entry's post-state: ``size``, ``offset`` (bytes), ``state``, ``holders``,
``waiters``, ``doomed``, ``tainted``. A fence is two events with the same ``fence`` id (fences
may overlap): ``BeginFence`` carries its snapshot's ``keys`` (the QUARANTINED entries),
``Fence`` the ``keys`` it freed; a failed ``BeginLoad`` carries the requested ``size`` and the
reason as its outcome.
``tla/check.py --trace FILE`` checks a trace against the TLA+ spec.

The core buffers the events under the cache lock; the driver hands them to a ``TraceOutbox``
after it drops the lock, which appends them to the sink in ``seq`` order, no lock held.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from embcache.driver.locks import TRACE_LEVEL, new_lock


class TraceSink(Protocol):
    """Where trace events go: a list, or anything with ``append``."""

    def append(self, event: dict[str, Any], /) -> None: ...


class TraceLog:
    """An in-memory trace."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def append(self, event: dict[str, Any], /) -> None:
        """Record one event."""
        self.events.append(event)

    def write_jsonl(self, path: str | Path) -> None:
        """Write the events to ``path``, one JSON object a line."""
        with open(path, "w", encoding="utf-8") as out:
            for event in self.events:
                out.write(json.dumps(event, sort_keys=True) + "\n")


class TraceOutbox:
    """Delivers batches of events (each a run of consecutive ``seq``) to a sink in ``seq``
    order, whichever thread hands them in first; the sink is called with no lock held, by one
    thread at a time."""

    def __init__(self, sink: TraceSink) -> None:
        self._sink = sink
        self._lock = new_lock(TRACE_LEVEL, "trace lock")
        self._next = 1  # the seq of the next event to deliver
        self._waiting: dict[int, list[dict[str, Any]]] = {}  # first seq -> batch
        self._delivering = False

    def waiting_batches(self) -> int:
        """How many batches were handed in and are not delivered yet. O(1)."""
        with self._lock:
            return len(self._waiting)

    def deliver(self, events: list[dict[str, Any]]) -> None:
        """Hand in one batch; delivers it and every batch now due, unless another thread is
        delivering (it then delivers this one too)."""
        with self._lock:
            self._waiting[events[0]["seq"]] = events
            if self._delivering:
                return
            self._delivering = True
        batch: list[dict[str, Any]] | None = None
        try:
            while True:
                with self._lock:
                    batch = self._waiting.pop(self._next, None)
                    if batch is None:
                        self._delivering = False
                        return
                    self._next = batch[-1]["seq"] + 1
                for event in batch:
                    self._sink.append(event)
        except BaseException:
            with self._lock:
                self._delivering = False
            raise
