"""Realistic mix: contiguity-aware eviction against first fit with plain LRU.

Entries are vision-encoder outputs of 64..4096 tokens x 3584 hidden (log-uniform tokens; 70%
bf16, 30% fp32: 0.45 MB to 58.7 MB) in a 1 GiB pool. Requests of 1-3 distinct images drawn
with Zipf reuse look their items up, reserve and insert the misses, and stay open (pinned)
while the next few requests run, as concurrent requests do in a server.

Ours is a real ``EmbeddingCache`` (1 GiB pool, real copies of real-sized tensors, one source
tensor per dtype sliced per size) under ``lru``, the baselines' order: what is compared is where
eviction makes room, and a frequency policy's refused admissions would count as failed inserts.
Its trace feeds a shadow of the pool layout so that every
failed allocation can be checked against an independent oracle. The baselines replay the same
requests over ``tests.support.baselines.NaiveAllocator`` (first fit) with plain LRU eviction:
- ``LRU-to-fit``: evict the oldest idle entry until the allocation succeeds or none is left;
- ``LRU-to-bytes``: evict the oldest until enough bytes are free, then allocate once (the
  design contiguity-aware eviction replaces: evictions of non-adjacent entries, then the
  allocation fails anyway).

Reported against each baseline: allocation failures although a fitting run existed (a
contiguous run of free blocks and idle entries, at most ``max_eviction_batch`` of them, that
holds the request; target 0), bytes evicted that served no allocation (evicted ranges that the
allocation does not overlap, or every eviction of a failed one; target 0), and hit ratio.
Two informational rows per baseline explain the hit ratios: the share of encoder tokens
saved (hits weighted by their token count: what a hit is worth, since encoder time grows with
tokens), and the hit ratio of the same mix when the popularity ranking is reshuffled every
``drift_every`` requests (serving traffic drifts; a cache that stops admitting new entries,
as LRU-to-bytes does once fragmented, keeps serving the old favourites).
Run from the repository root: python -m benchmarks.micro.bench_fragmentation [--quick]
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import print_rows
from embcache import EmbeddingCache, Request, Status
from tests.support.baselines import NaiveAllocator
from tests.support.mixes import (
    ALIGN,
    HIDDEN,
    MAX_TOKENS,
    Workload,
    aligned,
    drift_every,
    make_workload,
)

POOL_BYTES = 1 << 30
MAX_BATCH = 100
BASELINES = ("LRU-to-fit", "LRU-to-bytes")


# ---------------------------------------------------------------------------- oracle
def fitting_run(blocks: list[tuple[int, int, str]], need: int, max_batch: int) -> bool:
    """Whether a contiguous run of "free" and "idle" blocks with at most ``max_batch`` idle
    ones holds ``need`` bytes. ``blocks`` cover the pool in address order. O(n)."""
    left, victims, span = 0, 0, 0
    for right, (_, size, kind) in enumerate(blocks):
        if kind == "busy":
            left, victims, span = right + 1, 0, 0
            continue
        span += size
        victims += kind == "idle"
        while victims > max_batch:
            _, dropped, dropped_kind = blocks[left]
            span -= dropped
            victims -= dropped_kind == "idle"
            left += 1
        if span >= need:
            return True
    return False


def layout(entries: list[tuple[int, int, bool]], capacity: int) -> list[tuple[int, int, str]]:
    """Blocks in address order from ``(offset, size, idle)`` entries; the gaps are free."""
    blocks: list[tuple[int, int, str]] = []
    cursor = 0
    for offset, size, idle in sorted(entries):
        if offset > cursor:
            blocks.append((cursor, offset - cursor, "free"))
        blocks.append((offset, size, "idle" if idle else "busy"))
        cursor = offset + size
    if cursor < capacity:
        blocks.append((cursor, capacity - cursor, "free"))
    return blocks


@dataclass
class Tally:
    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    attempts: int = 0  # allocations tried (misses to insert)
    failures: int = 0
    failures_with_run: int = 0  # a fitting run existed (oracle)
    failures_with_bytes: int = 0  # free + idle bytes sufficed
    evictions: int = 0
    evicted_bytes: int = 0
    inserted_bytes: int = 0  # of the allocations that succeeded
    wasted_bytes: int = 0  # evicted, and the allocation did not use the range
    seconds: float = 0.0

    def judge_failure(self, blocks: list[tuple[int, int, str]], need: int) -> None:
        self.failures += 1
        self.failures_with_run += fitting_run(blocks, need, MAX_BATCH)
        self.failures_with_bytes += sum(s for _, s, k in blocks if k != "busy") >= need

    def end_allocation(self, evicted: list[tuple[int, int]], offset: int | None, size: int) -> None:
        self.evictions += len(evicted)
        self.evicted_bytes += sum(s for _, s in evicted)
        if offset is None:
            self.wasted_bytes += sum(s for _, s in evicted)
        else:
            self.wasted_bytes += sum(s for o, s in evicted if o + s <= offset or o >= offset + size)


def check_counts(workload: Workload, tally: Tally) -> Tally:
    """``tally``, or ``AssertionError`` unless it counted ``workload`` as every contender must
    for their rows to compare: every lookup and its tokens, one insert attempt per miss, at
    most that many failures, no negative eviction count, and some tokens both saved and not."""
    tokens = sum(workload.specs[i].tokens for r in workload.requests for i in r)
    checks = {
        "every lookup": tally.lookups == sum(len(r) for r in workload.requests),
        "every lookup's tokens": tally.lookup_tokens == tokens,
        "an attempt per miss": tally.attempts == tally.lookups - tally.hits,
        "failures within attempts": 0 <= tally.failures <= tally.attempts,
        "evictions counted": tally.evictions >= 0 and tally.evicted_bytes >= 0,
        "some tokens saved, not all": 0 < tally.hit_tokens < tokens,
    }
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise AssertionError(f"a tally miscounts the mix ({', '.join(failed)}): {tally}")
    return tally


# ---------------------------------------------------------------------------- ours
class Shadow:
    """The pool layout as the cache's trace tells it, checked at every allocation."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.entries: dict[str, tuple[int, int, bool]] = {}
        self.evicted: list[tuple[int, int]] = []

    def consume(self, trace: list[dict[str, Any]]) -> None:
        for event in trace:
            action = event["action"]
            if action == "Evict":
                self.evicted.append((event["offset"], event["size"]))
            elif action == "BeginLoad":
                self.tally.attempts += 1
                if event["outcome"] == "OK":
                    self.tally.end_allocation(self.evicted, event["offset"], event["size"])
                else:
                    blocks = layout(list(self.entries.values()), POOL_BYTES)
                    self.tally.judge_failure(blocks, aligned(event["size"]))
                    self.tally.end_allocation(self.evicted, None, 0)
                self.evicted = []
            if event.get("state") is not None and event["key"] is not None:
                self.apply(event)
        trace.clear()

    def apply(self, event: dict[str, Any]) -> None:
        if event["state"] == "ABSENT":
            self.entries.pop(event["key"], None)
            return
        idle = (
            event["state"] == "READY"
            and not event["holders"]
            and not event["doomed"]
            and not event["tainted"]
        )
        self.entries[event["key"]] = (event["offset"], event["size"], idle)


def run_ours(workload: Workload) -> Tally:
    tally = Tally()
    trace: list[dict[str, Any]] = []
    shadow = Shadow(tally)
    sources = {
        dtype: torch.empty(MAX_TOKENS * HIDDEN, dtype=dtype)
        for dtype in (torch.bfloat16, torch.float32)
    }
    start = time.perf_counter()
    with EmbeddingCache(
        POOL_BYTES,
        alignment=ALIGN,
        max_eviction_batch=MAX_BATCH,
        pin_memory=False,
        io_workers=1,
        trace=trace,
        policy="lru",  # the baselines' eviction order; a refused admission is no failed allocation
    ) as cache:
        open_requests: deque[Request] = deque()
        for n, indices in enumerate(workload.requests):
            specs = [workload.specs[i] for i in indices]
            request = cache.request(f"r{n}")
            statuses = request.lookup([s.item for s in specs], prefetch=False, reserve_misses=True)
            tally.lookups += len(specs)
            tally.hits += sum(s.status is Status.HIT for s in statuses)
            tally.lookup_tokens += sum(sp.tokens for sp in specs)
            tally.hit_tokens += sum(
                sp.tokens for sp, st in zip(specs, statuses, strict=True) if st.status is Status.HIT
            )
            reserved = [
                sp for sp, st in zip(specs, statuses, strict=True) if st.status is Status.RESERVED
            ]
            if reserved:
                tensors = [
                    sources[s.dtype][: s.tokens * HIDDEN].view(s.tokens, HIDDEN) for s in reserved
                ]
                assert all(request.insert([s.key for s in reserved], tensors, publish=False))
            open_requests.append(request)
            if len(open_requests) > workload.inflight:
                open_requests.popleft().close()
            shadow.consume(trace)
        while open_requests:
            open_requests.popleft().close()
        shadow.consume(trace)
        cache.check_invariants()
        stats = cache.stats()
        assert stats.pinned_entries == 0
        assert stats.evictions == tally.evictions and stats.evicted_bytes == tally.evicted_bytes
        assert stats.hits == tally.hits
    tally.seconds = time.perf_counter() - start
    return tally


# ---------------------------------------------------------------------------- baselines
def run_baseline(workload: Workload, mode: str, pool_bytes: int = POOL_BYTES) -> Tally:
    """Replay ``workload`` over first fit of ``pool_bytes`` with plain LRU (``mode`` in
    ``BASELINES``)."""
    tally = Tally()
    start = time.perf_counter()
    allocator = NaiveAllocator(pool_bytes, ALIGN)
    free_bytes = pool_bytes
    entries: dict[int, tuple[int, int]] = {}
    pins: Counter[int] = Counter()
    lru: OrderedDict[int, None] = OrderedDict()  # idle entries, oldest first
    open_requests: deque[list[int]] = deque()

    def pin(index: int) -> None:
        pins[index] += 1
        lru.pop(index, None)

    def release(held: list[int]) -> None:
        for index in held:
            pins[index] -= 1
            if not pins[index]:
                del pins[index]
                lru[index] = None

    for indices in workload.requests:
        held = [i for i in indices if i in entries]
        for index in held:
            pin(index)
        tally.lookups += len(indices)
        tally.hits += len(held)
        tally.lookup_tokens += sum(workload.specs[i].tokens for i in indices)
        tally.hit_tokens += sum(workload.specs[i].tokens for i in held)
        for index in (i for i in indices if i not in entries):
            size = aligned(workload.specs[index].nbytes)
            tally.attempts += 1
            offset = allocator.allocate(size)
            blocks = None
            evicted: list[tuple[int, int]] = []
            if offset is None:
                idle = set(lru)
                blocks = layout([(o, s, i in idle) for i, (o, s) in entries.items()], pool_bytes)
            while offset is None and lru:
                if mode == "LRU-to-bytes" and free_bytes >= size:
                    break
                victim, _ = lru.popitem(last=False)
                victim_offset, victim_size = entries.pop(victim)
                free_bytes += allocator.free(victim_offset)
                evicted.append((victim_offset, victim_size))
                offset = allocator.allocate(size)
            tally.end_allocation(evicted, offset, size)
            if offset is None:
                assert blocks is not None
                tally.judge_failure(blocks, size)
                continue
            free_bytes -= size
            tally.inserted_bytes += size
            entries[index] = (offset, size)
            pin(index)
            held.append(index)
        open_requests.append(held)
        if len(open_requests) > workload.inflight:
            release(open_requests.popleft())
    tally.seconds = time.perf_counter() - start
    return tally


# ---------------------------------------------------------------------------- report
def row(
    name: str, ours: float, baseline: float, unit: str, target: str, met: bool | None
) -> dict[str, Any]:
    if unit == "%":
        ratio = ours / baseline if baseline else 1.0
    else:
        ratio = baseline / ours if ours else (math.inf if baseline else 1.0)
    return {
        "name": name,
        "ours": ours,
        "baseline": baseline,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "met": met,
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows ``{name, ours, baseline, unit, ratio, target, met}`` against both baselines."""
    workload = make_workload(quick)
    ours = check_counts(workload, run_ours(workload))
    drifting = make_workload(quick, drifting=True)
    ours_drifting = check_counts(drifting, run_ours(drifting))
    drift = f"drifting mix (every {drift_every(quick)} requests): "
    # name, unit, value of a tally (the steady mix's, or the drifting mix's), target, met
    metrics: list[tuple[str, str, Callable[[Tally, Tally], float], str, bool | None]] = [
        (
            "fails, fitting run existed",
            "allocs",
            lambda t, _: t.failures_with_run,
            "= 0",
            ours.failures_with_run == 0,
        ),
        ("fails, enough bytes idle", "allocs", lambda t, _: t.failures_with_bytes, "", None),
        ("failed allocations", "%", lambda t, _: 100 * t.failures / t.attempts, "", None),
        (
            "evicted for nothing",
            "MiB",
            lambda t, _: t.wasted_bytes / 2**20,
            "= 0",
            ours.wasted_bytes == 0,
        ),
        ("evicted in all", "MiB", lambda t, _: t.evicted_bytes / 2**20, "", None),
        ("hit ratio", "%", lambda t, _: 100 * t.hits / t.lookups, "", None),
        ("encoder tokens saved", "%", lambda t, _: 100 * t.hit_tokens / t.lookup_tokens, "", None),
        (drift + "hit ratio", "%", lambda _, d: 100 * d.hits / d.lookups, "", None),
    ]
    rows = []
    for mode in BASELINES:
        base = (
            check_counts(workload, run_baseline(workload, mode)),
            check_counts(drifting, run_baseline(drifting, mode)),
        )
        rows += [
            row(f"{name}, {mode}", value(ours, ours_drifting), value(*base), unit, target, met)
            for name, unit, value, target, met in metrics
        ]
    rows.append(
        {
            "name": f"ours: {ours.attempts} inserts, {ours.lookups} lookups",
            "ours": ours.seconds,
            "baseline": None,
            "unit": "s",
            "ratio": 1.0,
            "target": "",
            "met": None,
        }
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
