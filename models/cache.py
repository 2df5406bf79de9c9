"""Reference model of ``embcache.EmbeddingCache``: single-threaded, O(n) everywhere, obvious.

It keeps the same entries, pins, waiters and LRU order as the real cache, predicts every
lookup status, every allocation offset and every eviction victim, and models the global store
(objects by size, per-key faults) and the I/O tasks the real cache would hand to its workers.
Victims are found by brute force over every run of free blocks and candidates, without the
real code's neighbourhood shortcut, so the two implementations check each other.

Vocabulary (DESIGN.md): Lookup, BeginLoad, EndLoad, Release, Evict, Remove, Publish,
EndPublish, BeginFence, Fence, OpenRequest, CloseRequest. Every entry has a generation (a number
no other entry ever had); a fence's snapshot is a list of (key, generation), so a fence that
overlaps another frees only the entries it saw, never a key QUARANTINED again since.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from models.allocator import ModelAllocator
from models.backlog import ModelBacklog
from models.policy import MODELS

OK, FAILED, UNKNOWN = "OK", "FAILED", "UNKNOWN"


@dataclass
class MEntry:
    key: str
    shape: tuple[int, ...]
    dtype: object
    nbytes: int
    offset: int
    size: int
    from_store: bool
    state: str = "LOADING"
    holders: set[object] = field(default_factory=set)
    waiters: set[str] = field(default_factory=set)
    filler: str | None = None
    doomed: bool = False
    tainted: bool = False
    publishing: bool = False
    gen: int = 0  # which entry of this key: unique over the model's life


@dataclass
class MRequest:
    items: list[tuple[str, tuple[int, ...], object, int]] = field(default_factory=list)
    holds: list[str] = field(default_factory=list)  # in pin order
    waits: set[str] = field(default_factory=set)
    reserved: set[str] = field(default_factory=set)
    fallbacks: dict[str, str] = field(default_factory=dict)


@dataclass
class Task:
    kind: str  # "load" or "publish"
    keys: list[str]
    request: str | None = None


class ModelCache:
    def __init__(
        self,
        capacity: int,
        alignment: int,
        max_batch: int,
        eviction: bool,
        policy: str = "lru",
        backlog: int | None = None,
        **knobs: Any,
    ) -> None:
        self.alloc = ModelAllocator(capacity, alignment)
        self.policy = MODELS[policy](**knobs)
        self.capacity = capacity
        self.max_batch = max_batch
        self.eviction = eviction
        self.entries: dict[str, MEntry] = {}
        self.order = self.policy.order()  # the evictable keys, first victim first
        self.requests: dict[str, MRequest] = {}
        self.store: dict[str, int] = {}  # key -> object size in bytes
        self.faults: dict[str, str] = {}  # key -> fail / unknown / short / raise
        self.tasks: list[Task] = []
        self.counts: Counter[str] = Counter()
        self.generations = 0  # entries made so far
        self.fences = 0  # fences begun so far: the id of the last one
        self.snapshots: dict[int, list[tuple[str, int]]] = {}  # fences in flight
        # failed publishes retried (``backlog`` entries at most; None: never retried)
        self.backlog = None if backlog is None else ModelBacklog(backlog)
        self.failed_gen: dict[str, int] = {}  # key -> the entry (gen) whose publish failed last
        self.batches = 0  # internal requests opened so far (``republish#N``)

    # -- requests --
    def open_request(self, r: str) -> None:
        self.requests[r] = MRequest()

    def close_request(self, r: str) -> None:
        rq = self.requests[r]
        for k in sorted(rq.reserved):
            self.end_load(k, FAILED, "abandoned")
        for k in sorted(rq.waits):
            self.release(r, k)
        looked = [k for k, _, _, _ in rq.items if k in rq.holds]  # lookup order, first time
        order = [k for i, k in enumerate(looked) if k not in looked[:i]]
        for k in order + [k for k in rq.holds if k not in order]:
            self.release(r, k)
        del self.requests[r]

    # -- lookup --
    def lookup_one(self, r: str, key: str, shape: tuple[int, ...], dtype: object) -> tuple:
        rq, e = self.requests[r], self.entries.get(key)
        if e is None:
            return ("MISS", "not_found")
        if (e.shape, e.dtype) != (shape, dtype):
            return ("MISS", "mismatch")
        if e.doomed or e.state not in ("READY", "LOADING"):
            return ("MISS", "busy")
        if e.state == "READY":
            if r not in e.holders:
                self.pin(e, r)
                rq.holds.append(key)
            self.counts["hits"] += 1
            return ("HIT", None)
        if r not in e.waiters:
            e.waiters.add(r)
            rq.waits.add(key)
            self.counts["joins"] += 1
        return ("RESERVED", None) if e.filler == r else ("LOADING", None)

    def lookup(self, r: str, items: list, prefetch: bool, reserve: bool) -> list[tuple]:
        rq = self.requests[r]
        statuses = []
        for key, shape, dtype, nbytes in items:
            self.policy.record(key)
            s = self.lookup_one(r, key, shape, dtype)
            if s == ("MISS", "not_found") and nbytes > self.capacity:
                s = ("MISS", "too_large")
            statuses.append(s)
        new_loads = []
        for i, (key, shape, dtype, nbytes) in enumerate(items):
            if statuses[i] != ("MISS", "not_found"):
                continue
            in_store = prefetch and key in self.store
            if key in self.entries:
                statuses[i] = self.lookup_one(r, key, shape, dtype)
            elif not (in_store or reserve):
                statuses[i] = ("MISS", "not_found")
            else:
                reason = self.begin_load(r, key, shape, dtype, nbytes, from_store=in_store)
                if reason is not None:
                    statuses[i] = ("MISS", reason)
                elif in_store:
                    new_loads.append(key)
                    statuses[i] = ("LOADING", None)
                else:
                    statuses[i] = ("RESERVED", None)
        for (key, *_), s in zip(items, statuses, strict=True):
            if s[1] is not None:
                rq.fallbacks[key] = s[1]
                self.counts["miss:" + s[1]] += 1
        rq.items.extend(items)
        if new_loads:
            self.tasks.append(Task("load", new_loads))
        return statuses

    # -- allocation and eviction --
    def begin_load(self, r, key, shape, dtype, nbytes, *, from_store: bool) -> str | None:
        assert key not in self.entries
        if nbytes > self.capacity:
            self.counts["alloc_fail:too_large"] += 1
            return "too_large"
        size = self.alloc.rounded(nbytes)
        offset = self.alloc.allocate(size)
        if offset is None and self.eviction:
            victims = self.choose_victims(size)
            if victims is not None and not self.policy.admit(key, size, victims):
                self.counts["alloc_fail:not_admitted"] += 1
                return "not_admitted"
            if victims is not None:
                for k in victims:
                    self.evict(k)
                offset = self.alloc.allocate(size)
                assert offset is not None
        if offset is None:
            self.counts["alloc_fail:no_space"] += 1
            return "no_space"
        self.generations += 1
        e = MEntry(key, shape, dtype, nbytes, offset, size, from_store, waiters={r})
        e.gen = self.generations
        e.filler = None if from_store else r
        self.entries[key] = e
        self.requests[r].waits.add(key)
        if not from_store:
            self.requests[r].reserved.add(key)
        return None

    def blocks(self) -> list[tuple[int, int, str | None]]:
        """Every block in address order: (offset, size, key or None when free)."""
        used = [(e.offset, e.size, e.key) for e in self.entries.values()]
        free = [(o, s, None) for o, s in self.alloc.free_blocks()]
        return sorted(used + free)

    def choose_victims(self, need: int) -> list[str] | None:
        """Smallest k; then fewest victims, fewest bytes, lowest offset. Brute force."""
        for k in range(1, len(self.lru) + 1):
            candidates = set(self.lru[:k])
            runs, run = [], []
            for block in self.blocks():
                if block[2] is None or block[2] in candidates:
                    run.append(block)
                else:
                    runs.append(run)
                    run = []
            runs.append(run)
            best = None
            for run in runs:
                if not run:
                    continue
                victims = [b for b in run if b[2] is not None]
                for a in range(len(victims)):
                    for b in range(a, min(len(victims), a + self.max_batch)):
                        start = victims[a - 1][0] + victims[a - 1][1] if a else run[0][0]
                        end = victims[b + 1][0] if b + 1 < len(victims) else run[-1][0] + run[-1][1]
                        if end - start >= need:
                            chosen = victims[a : b + 1]
                            cost = (len(chosen), sum(v[1] for v in chosen), start)
                            if best is None or cost < best[0]:
                                best = (cost, [v[2] for v in chosen])
            if best is not None:
                return best[1]
        return None

    def evict(self, key: str) -> None:
        e = self.entries[key]
        assert e.state == "READY" and not e.holders and not e.doomed and key in self.lru
        self.free(e)
        self.counts["evictions"] += 1
        self.counts["evicted_bytes"] += e.size

    # -- end of transfers --
    def end_load(self, key: str, outcome: str, failed_reason: str | None) -> None:
        e = self.entries[key]
        assert e.state == "LOADING"
        if e.filler is not None:
            self.requests[e.filler].reserved.discard(key)
            e.filler = None
        if e.from_store:
            self.counts["loads_" + outcome.lower()] += 1
        waiters = sorted(e.waiters)
        for r in waiters:
            self.requests[r].waits.discard(key)
        e.waiters = set()
        if outcome == OK and not e.doomed:
            e.state = "READY"
            for r in waiters:
                self.pin(e, r)
                self.requests[r].holds.append(key)
            if not e.holders:
                self.order.add(key)
            return
        if outcome == UNKNOWN:
            reason = "load_unknown"
        elif e.doomed:
            reason = "removed"
        else:
            reason = failed_reason or "load_failed"
        for r in waiters:
            self.requests[r].fallbacks[key] = reason
            self.counts["fallback:" + reason] += 1
        e.doomed = False
        if outcome == UNKNOWN:
            e.state = "QUARANTINED"
        else:
            self.free(e)

    def run_task(self, index: int) -> None:
        task = self.tasks.pop(index)
        raised = any(self.faults.get(k) == "raise" for k in task.keys)
        if task.kind == "load":
            for k in task.keys:
                self.end_load(k, UNKNOWN if raised else self.load_outcome(k), None)
            return
        outcomes = []
        for k in task.keys:
            outcome = UNKNOWN if raised else self.put_outcome(k)
            e = self.entries[k]
            e.publishing = False
            if outcome == UNKNOWN:
                e.tainted = True
            self.counts["publishes_" + outcome.lower()] += 1
            if outcome == FAILED:
                self.failed_gen[k] = e.gen  # that very entry waits, not the key's next one
            self.drop_pin(e, ("publish", task.request))
            outcomes.append(outcome)
        if self.backlog is not None:
            self.backlog.note(task.keys, outcomes)

    def load_outcome(self, key: str) -> str:
        fault = self.faults.get(key)
        if fault == "unknown":
            return UNKNOWN
        if fault in ("fail", "short"):
            return FAILED
        return OK if self.store.get(key) == self.entries[key].nbytes else FAILED

    def put_outcome(self, key: str) -> str:
        fault = self.faults.get(key)
        if fault == "unknown":
            return UNKNOWN
        if fault in ("fail", "short"):
            return FAILED
        self.store.setdefault(key, self.entries[key].nbytes)
        return OK

    # -- pins --
    def pin(self, e: MEntry, holder: object) -> None:
        if not e.holders and e.key in self.order:
            self.order.discard(e.key)
        e.holders.add(holder)

    def release(self, r: str, key: str) -> None:
        rq, e = self.requests[r], self.entries[key]
        if key in rq.waits:
            e.waiters.discard(r)
            rq.waits.discard(key)
        else:
            rq.holds.remove(key)
            self.drop_pin(e, r)

    def drop_pin(self, e: MEntry, holder: object) -> None:
        e.holders.remove(holder)
        if e.holders:
            return
        if e.tainted:
            e.state, e.tainted, e.doomed = "QUARANTINED", False, False
        elif e.doomed:
            self.free(e)
        else:
            self.order.add(e.key)

    # -- insert and publish --
    def insert(
        self, r: str, items: list, publish: bool, work: list[float] | None = None
    ) -> list[bool]:
        rq = self.requests[r]
        filling: list[tuple[int, str]] = []
        for i, (key, shape, dtype, nbytes) in enumerate(items):
            if any(k == key for _, k in filling):
                continue
            if key in rq.reserved:
                filling.append((i, key))
            elif key not in self.entries:
                if self.begin_load(r, key, shape, dtype, nbytes, from_store=False) is None:
                    filling.append((i, key))
        results = [False] * len(items)
        for i, key in filling:
            self.end_load(key, OK, "load_failed")
            results[i] = key in self.entries and self.entries[key].state == "READY"
        self.counts["inserts"] += sum(results)
        if work is not None and getattr(self.policy, "note_work", None) is not None:
            for (key, _, _, nbytes), seconds in zip(items, work, strict=True):
                e = self.entries.get(key)
                if e is not None and e.state == "READY":
                    self.policy.note_work(key, seconds, e.size)
                else:
                    unit = self.alloc.alignment
                    self.policy.note_encoded(key, seconds, max(-(-nbytes // unit) * unit, unit))
        if publish:
            started = []
            for i, key in filling:
                e = self.entries.get(key)
                if results[i] and e and key in rq.holds and not e.publishing:
                    e.publishing = True
                    self.pin(e, ("publish", r))
                    self.counts["publishes_started"] += 1
                    started.append(key)
            if started:
                self.tasks.append(Task("publish", started, r))
        return results

    def publish(self, r: str, keys: list[str]) -> list[bool]:
        """Publish each key ``r`` holds READY that is not being published already."""
        results, started = [], []
        for key in keys:
            e = self.entries.get(key)
            ok = (
                e is not None
                and key in self.requests[r].holds
                and e.state == "READY"
                and not e.publishing
            )
            if ok:
                self.start_publish(e, r)
                started.append(key)
            results.append(ok)
        if started:
            self.tasks.append(Task("publish", started, r))
        return results

    def start_publish(self, e: MEntry, r: str) -> None:
        e.publishing = True
        self.pin(e, ("publish", r))
        self.counts["publishes_started"] += 1

    def retry(self, limit: int | None) -> int:
        """The republisher's step: publish again the ``limit`` oldest failed publishes still
        their key's entry (the very entry that failed), READY, not doomed, tainted or being
        published, under an internal request that pins each and closes at once (no hit
        counted); the rest are stale. When all taken were stale, the next ``limit`` oldest,
        until one is published or none waits. How many started."""
        while self.backlog is not None and (keys := self.backlog.take(limit)):
            if started := self.retry_taken(keys):
                return started
        return 0

    def retry_taken(self, keys: list[str]) -> int:
        """One retry of ``keys`` (taken from the backlog): how many started."""
        assert self.backlog is not None
        self.batches += 1
        r = f"republish#{self.batches}"
        live = []
        for key in keys:
            e = self.entries.get(key)
            if (
                e
                and e.gen == self.failed_gen[key]
                and e.state == "READY"
                and not (e.doomed or e.tainted or e.publishing)
            ):
                live.append(key)
            else:
                self.backlog.skipped(key)
        for key in live:
            self.pin(self.entries[key], r)
        for key in live:
            self.start_publish(self.entries[key], r)
        if live:
            self.tasks.append(Task("publish", live, r))
        for key in live:
            self.drop_pin(self.entries[key], r)
        return len(live)

    # -- removal and fence --
    def remove(self, key: str) -> bool:
        e = self.entries.get(key)
        if e is None or e.doomed or e.state == "QUARANTINED":
            return False
        if e.state == "READY" and not e.holders:
            self.free(e)
        else:
            e.doomed = True
        return True

    def clear(self) -> int:
        return sum(self.remove(k) for k in list(self.entries))

    def fence(self) -> int:
        return self.end_fence(self.begin_fence())

    def begin_fence(self) -> int:
        """A fence begins: it will free what is QUARANTINED now. Returns its id."""
        self.fences += 1
        self.snapshots[self.fences] = [
            (e.key, e.gen) for e in self.entries.values() if e.state == "QUARANTINED"
        ]
        return self.fences

    def end_fence(self, fence: int) -> int:
        """Fence ``fence`` ends: free its snapshot's entries that are still the same ones."""
        freed = 0
        for key, gen in self.snapshots.pop(fence):
            e = self.entries.get(key)
            if e is not None and e.gen == gen:
                assert e.state == "QUARANTINED"  # only a fence ends a quarantine
                self.free(e)
                freed += 1
        return freed

    def free(self, e: MEntry) -> None:
        self.alloc.free(e.offset)
        del self.entries[e.key]
        self.order.discard(e.key)
        self.policy.forget(e.key)

    @property
    def lru(self) -> list[str]:
        """The eviction order as a list, first victim first."""
        return list(self.order)

    # -- what the caller sees --
    def serves(self, r: str, key: str, shape: tuple[int, ...], dtype: object) -> bool:
        e = self.entries.get(key)
        return (
            key in self.requests[r].holds
            and e is not None
            and (e.shape, e.dtype)
            == (
                shape,
                dtype,
            )
        )

    def fallback_mask(self, r: str) -> list[int]:
        return [0 if self.serves(r, k, s, d) else 1 for k, s, d, _ in self.requests[r].items]

    def fallback_reasons(self, r: str) -> list[str | None]:
        rq, out = self.requests[r], []
        for key, shape, dtype, _ in rq.items:
            if self.serves(r, key, shape, dtype):
                out.append(None)
            elif key in rq.holds:
                out.append("mismatch")
            elif key in rq.reserved:
                out.append("not_found")
            elif key in rq.waits:
                out.append("timeout")
            else:
                out.append(rq.fallbacks.get(key))
        return out
