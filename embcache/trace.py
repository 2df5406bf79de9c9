"""Execution traces: one event per action, in lock order, as JSON lines.

Pass a ``TraceLog`` (or any object with ``append``) as ``EmbeddingCache(trace=...)``. The first
event, ``Init``, records ``capacity``, ``alignment``, ``max_eviction_batch`` and
``enable_eviction``. Each later event
is a dict with ``seq``, ``action`` (a DESIGN.md action name), ``request``, ``key``, ``outcome``
and, when the action touched an entry, the entry's post-state: ``size``, ``offset`` (bytes),
``state``, ``holders``, ``waiters``, ``doomed``, ``tainted``. A fence is two events with the
same ``fence`` id (fences may overlap): ``BeginFence`` carries its snapshot's ``keys`` (the
QUARANTINED entries), ``Fence`` the ``keys`` it freed; a failed ``BeginLoad`` carries the
requested ``size`` and the reason as its outcome.
``tla/check.py --trace FILE`` checks a trace against the TLA+ spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TraceLog:
    """An in-memory trace; appended to under the cache lock only."""

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


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The events of a trace file written by ``TraceLog.write_jsonl``."""
    with open(path, encoding="utf-8") as source:
        return [json.loads(line) for line in source if line.strip()]
