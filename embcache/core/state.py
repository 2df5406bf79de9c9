"""``CoreState``: the cache's one state, every field in one object (embcache/DESIGN.md, "One
owner, few steps").

It holds what the DESIGN actions change: the entries, the open requests, the allocator, the
eviction order and its policy, the pin times, the quarantine, the fences in flight, the
counters, and the buffers a step hands to its driver (trace events, freed ranges). It is a plain
record with public fields and no behaviour beyond buffering: the actions that change it are
functions that receive it explicitly, grouped by responsibility (``embcache.core.entry_actions``:
the entry lifecycle; ``embcache.core.request_bodies``: a request's actions and bodies;
``embcache.core.publishing``: publishes and fences). ``embcache.core.cache_core.CacheCore`` is
its one owner: it builds it, keeps it private and hands it only to those functions; a driver
reads it through ``embcache.core.queries.StateQueries``, which changes nothing.

No threads, no clock of its own (the driver passes ``clock``), no torch, no store: not
thread-safe, the driver locks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from embcache.core.allocator import BestFitAllocator
from embcache.core.entries import Entry, RequestState
from embcache.core.eviction import INDEX_FROM, EvictionIndex
from embcache.core.policy import EvictionOrder, LruPolicy, Policy, WorkPolicy
from embcache.core.recency import RecencyOrder

MAX_SHAPES = 4096  # distinct item shapes interned at once (entries share one tuple per shape)


class CoreState:
    """Every piece of the cache's state (module docstring). Not thread-safe: the driver locks."""

    def __init__(
        self, capacity: int, alignment: int, max_eviction_batch: int, enable_eviction: bool, *,
        trace: bool = False, clock: Callable[[], float] = float, policy: Policy | None = None,
        record_freed: bool = False,
    ) -> None:  # fmt: skip
        self.allocator = BestFitAllocator(capacity, alignment)
        self.align = alignment
        self.max_batch = max_eviction_batch
        self.enable_eviction = enable_eviction
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self.requests: dict[str, RequestState] = {}
        self.pinned_since: dict[str, float] = {}  # pinned keys -> when the first pin came
        self.shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # interned: <= MAX_SHAPES
        self.policy: Policy = LruPolicy() if policy is None else policy
        self.order: EvictionOrder = self.policy.order()  # the evictable keys, first victim first
        order = self.order  # the eviction search's memory, for an order ranked by stamps
        self.index: EvictionIndex | None = (
            EvictionIndex(self.allocator, order, self.entries, max_eviction_batch)
            if isinstance(order, RecencyOrder)
            else None
        )
        self.index_from = INDEX_FROM  # searches use the index from this many candidates
        # The policy's record of each looked-up key; None when it records nothing (lru).
        records = getattr(self.policy, "records_lookups", True)
        self.record: Callable[[str], None] | None = self.policy.record if records else None
        # The policy that keeps fresh outputs' encoder work; None when it keeps none.
        works = getattr(self.policy, "records_work", False)
        self.work_policy: WorkPolicy | None = self.policy if works else None  # type: ignore[assignment]
        self.evictable_bytes = 0  # bytes of the entries in ``order``
        self.batches = 0  # internal requests so far (their ids: ``insert#N``, ``republish#N``)
        self.counts: Counter[str] = Counter()
        self.quarantine: dict[str, float] = {}  # QUARANTINED keys -> when (core clock)
        self.fences_begun = 0  # the id of the last BeginFence
        self.fencing: dict[int, tuple[Entry, ...]] = {}  # fences in flight -> their snapshots
        self.seq = 0  # the last trace event's number
        self.events: list[dict[str, Any]] | None = [] if trace else None  # until taken
        self.freed: list[tuple[int, int]] | None = [] if record_freed else None  # until taken
        self.emit(
            "Init", None, capacity=capacity, alignment=alignment,
            max_eviction_batch=max_eviction_batch, enable_eviction=enable_eviction,
        )  # fmt: skip

    def emit(
        self, action: str, request: str | None, key: str | None = None,
        entry: Entry | None = None, outcome: str | None = None, **extra: Any,
    ) -> None:  # fmt: skip
        """Buffer the trace event of one action (when tracing; else nothing)."""
        events = self.events
        if events is None:
            return
        self.seq += 1
        event: dict[str, Any] = {
            "seq": self.seq,
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

    def take_events(self) -> list[dict[str, Any]]:
        """The trace events buffered since the last call, in order (none when not tracing)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def take_freed(self) -> list[tuple[int, int]]:
        """The ``(offset, size)`` ranges freed since the last call (with ``record_freed``)."""
        freed = self.freed
        if not freed:
            return []
        self.freed = []
        return freed
