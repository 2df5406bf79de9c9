"""Eviction policies x request mixes: encoder tokens saved, against every baseline.

Four mixes over the catalogue of ``tests.support.mixes`` (log-uniform 64..4096
tokens x 3584 hidden, 70% bf16, 0.45 to 58.7 MB; a 1 GiB pool; requests of 1-3 distinct
images, the last ``inflight`` requests held open):
- ``steady``: Zipf(0.9) popularity, a long stream (6000 requests: the cache's steady state);
- ``drift``: the same, with the popularity ranking reshuffled every 500 requests;
- ``scan``: the steady stream, and every third request one new image never seen again;
- ``1GiB``: the mix of ``bench_fragmentation`` itself (its full 2000 requests).
(``--quick``: the first three over the quick catalogue of 600 images, 1500 requests.)

``lru`` and ``tinylfu`` run through the real ``EmbeddingCache(policy=...)`` (real copies of
real-sized tensors), as the encode pipeline drives it (every miss encoded and inserted with its
work). Every contender also runs in ``simulate``: the real allocator (``RangeAllocator``) and
victim rule (``eviction.choose_victims``, its candidates the first entries of the policy's
eviction order) under the cache's actions in the cache's order (Lookup of every item:
``record``, a hit pins; a reserving BeginLoad per miss: ``admit`` when it must evict, a refusal
evicts nothing; the insert: a second BeginLoad for each miss refused at lookup, EndLoad OK, and
each output's work told to a policy that keeps it; the request's pins released in lookup order
when it closes). For ``lru`` and ``tinylfu``
the simulation must make exactly the real cache's hits, refusals and evictions (else the
benchmark fails), which is what lets the candidates run only simulated. ``--quick`` simulates
every contender and runs that check on the first 400 requests of the scan mix only (the real
copies take most of a full run's 40 s).
The baselines replay the same requests with plain LRU: LRU-to-fit and LRU-to-bytes
over first fit (``bench_fragmentation``) and the paged pool (``bench_paged``).
Contenders: ``lru`` (ours today), ``tinylfu`` (the policy chosen, ``embcache.core.policy``), and the
candidates it was chosen against: ``tinylfu`` with its shift detector off, ``s3fifo`` (a small
FIFO for new entries, a main LRU, ghosts of the small FIFO's victims; promotion on a second
lookup, not S3-FIFO's lazy CLOCK, which needs an order that changes while it is read) and
``gdsf`` (GreedyDual-Size-Frequency with cost = bytes, so LFU with dynamic aging).
Metrics: encoder tokens saved (tokens of the items served from the cache / all item tokens),
hit ratio, failed inserts (no run of free space and victims fits), refusals (not admitted).
Cost: what the policy's record + admit add to LRU's per looked-up item (the calls of the
steady mix replayed on both, with the order's add and discard and forget, so that the keys the
cache holds are resident) against a hit of an 8-item all-hit request through the real
cache; and that request's cost per item with ``tinylfu`` against ``lru``; chunks alternated,
timed in CPU time of the calling thread (``time.thread_time``: a shared machine's load, which
takes the CPU away between chunks, does not count).
Run from the repository root: python -m benchmarks.policy.bench_policy [--quick] [--json OUT];
``--check-real POLICY ... [--requests N]`` runs only that check, printing the real run's counts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from sortedcontainers import SortedList

from benchmarks.common import insert_all, make_row, print_rows
from benchmarks.micro import bench_fragmentation as frag
from benchmarks.micro import bench_hitpath, bench_paged
from embcache import EmbeddingCache, Item, Request, Status
from embcache.core.eviction import choose_victims
from embcache.core.policy import Policy, make_policy
from embcache.driver.allocator import Block, RangeAllocator
from tests.support import mixes
from tests.support.baselines import Pins
from tests.support.rows import json_row

MIXES = ("steady", "drift", "scan", "1GiB")
CHOSEN = "tinylfu"
DRIFT_EVERY = 500
SCAN_EVERY = 3
REAL = ("lru", CHOSEN)  # run through the real EmbeddingCache (and checked against simulate)
QUICK_CHECK = 400  # requests of the scan mix run through the real cache in quick mode
LRU_MARGIN = 3.0  # points of tokens saved over our LRU on the steady and scan mixes
COSTED = (CHOSEN, "adaptive")  # the policies whose record + admit and hit request are timed


# ---------------------------------------------------------------------------- mixes
def make_mix(mix: str, quick: bool, seed: int = 7) -> mixes.Workload:
    """The requests of ``mix`` (one of ``MIXES``) over the fragmentation catalogue."""
    if mix == "1GiB":  # short enough to run whole even in quick mode
        return mixes.make_workload(False, seed)
    base = mixes.make_workload(quick, seed)
    universe = len(base.specs)
    specs = list(base.specs)
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(universe)]
    ranks = list(range(universe))
    owner = list(range(universe))  # which image holds each popularity rank
    rng, shuffler = random.Random(seed + 100), random.Random(seed + 1)
    requests: list[list[int]] = []
    for n in range(1500 if quick else 6000):
        if mix == "drift" and n % DRIFT_EVERY == 0:
            shuffler.shuffle(owner)
        if mix == "scan" and n % SCAN_EVERY == SCAN_EVERY - 1:
            log_tokens = rng.uniform(math.log(mixes.MIN_TOKENS), math.log(mixes.MAX_TOKENS))
            dtype = specs[rng.randrange(universe)].dtype  # 70% bf16, as the catalogue
            specs.append(mixes.Spec(f"scan{n}", round(math.exp(log_tokens)), dtype))
            requests.append([len(specs) - 1])
            continue
        chosen: list[int] = []
        want = rng.randint(1, 3)
        while len(chosen) < want:
            image = owner[rng.choices(ranks, weights)[0]]
            if image not in chosen:
                chosen.append(image)
        requests.append(chosen)
    return mixes.Workload(specs, requests, base.inflight)


# ---------------------------------------------------------------------------- candidates
class S3FifoLike:
    """Research candidate: new entries in a small FIFO (first victims while it holds at least
    ``small_percent`` of the entries), promoted to a main LRU when looked up again; the small
    FIFO's victims leave ghosts, and a ghost that comes back enters main directly."""

    name = "s3fifo"

    def __init__(self, small_percent: int = 10) -> None:
        self.small_percent = small_percent
        self.small: OrderedDict[str, None] = OrderedDict()
        self.main: OrderedDict[str, None] = OrderedDict()
        self.ghosts: OrderedDict[str, None] = OrderedDict()
        self.lookups: dict[str, int] = {}  # per resident key, since it entered

    def order(self) -> _S3Order:
        return _S3Order(self)

    def enter(self, key: str) -> None:
        if key in self.main:
            self.main.move_to_end(key)
        elif key in self.small:
            if self.lookups[key]:
                del self.small[key]
                self.main[key] = None
        else:
            (self.main if self.ghosts.pop(key, 1) is None else self.small)[key] = None
            self.lookups[key] = 0

    def record(self, key: str) -> None:
        if key in self.lookups:
            self.lookups[key] += 1

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        return True

    def forget(self, key: str) -> None:
        if self.small.pop(key, 1) is None:
            self.ghosts[key] = None
            while len(self.ghosts) > max(1, len(self.main)):
                self.ghosts.popitem(last=False)
        self.main.pop(key, None)
        self.lookups.pop(key, None)


class _S3Order:
    def __init__(self, policy: S3FifoLike) -> None:
        self.policy = policy
        self.evictable: set[str] = set()

    def add(self, key: str) -> None:
        self.evictable.add(key)
        self.policy.enter(key)

    def discard(self, key: str) -> None:
        self.evictable.discard(key)

    def __iter__(self) -> Iterator[str]:
        p = self.policy
        entries = len(p.small) + len(p.main)
        small_full = len(p.small) * 100 >= p.small_percent * entries
        for segment in (p.small, p.main) if small_full else (p.main, p.small):
            yield from (key for key in segment if key in self.evictable)

    def __contains__(self, key: object) -> bool:
        return key in self.evictable

    def __len__(self) -> int:
        return len(self.evictable)


class Gdsf:
    """Research candidate: GreedyDual-Size-Frequency with cost = size (tokens are ~bytes), so
    priority = L + lookups while resident; the lowest priority goes first and L rises to
    each freed entry's priority."""

    name = "gdsf"

    def __init__(self) -> None:
        self.inflation = 0.0
        self.lookups: dict[str, int] = {}
        self.priority: dict[str, float] = {}
        self.added = 0

    def order(self) -> _PriorityOrder:
        return _PriorityOrder(self)

    def record(self, key: str) -> None:
        if key in self.lookups:
            self.lookups[key] += 1

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        return True

    def forget(self, key: str) -> None:
        self.inflation = max(self.inflation, self.priority.pop(key, 0.0))
        self.lookups.pop(key, None)


class _PriorityOrder:
    def __init__(self, policy: Gdsf) -> None:
        self.policy = policy
        self.items: SortedList = SortedList()
        self.where: dict[str, tuple[float, int, str]] = {}

    def add(self, key: str) -> None:
        self.discard(key)
        p = self.policy
        p.priority[key] = p.inflation + p.lookups.setdefault(key, 1)
        p.added += 1
        item = (p.priority[key], p.added, key)
        self.items.add(item)
        self.where[key] = item

    def discard(self, key: str) -> None:
        item = self.where.pop(key, None)
        if item is not None:
            self.items.remove(item)

    def __iter__(self) -> Iterator[str]:
        return (key for _, _, key in self.items)

    def __contains__(self, key: object) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)


CONTENDERS: dict[str, Callable[[], Any]] = {
    "lru": lambda: make_policy("lru"),
    CHOSEN: lambda: make_policy(CHOSEN),
    "tinylfu-no-shift": lambda: make_policy(CHOSEN, shift_drop=0),
    "adaptive": lambda: make_policy("adaptive"),
    "s3fifo": S3FifoLike,
    "gdsf": Gdsf,
}


# ---------------------------------------------------------------------------- simulation
class Simulated:
    """The cache's entries, pins and eviction order over the real allocator and victim rule;
    ``policy`` decides the order and admission. ``calls`` logs, when not None, the policy's
    calls: record ``(key,)``, admit ``(key, nbytes, victims)``, ``(step, key)`` for the
    order's add and discard and the policy's forget (what makes keys resident), and
    ``("work" or "encoded", key, seconds, size)`` for ``note_work`` and ``note_encoded`` (a
    policy that keeps work)."""

    def __init__(self, capacity: int, policy: Policy, calls: list[tuple[Any, ...]] | None) -> None:
        self.inserted_bytes = self.evicted_bytes = 0
        self.allocator = RangeAllocator(capacity, mixes.ALIGN)
        self.policy = policy
        self.order = policy.order()
        self.entries: dict[str, tuple[int, int]] = {}  # key -> (offset, size)
        self.by_offset: dict[int, str] = {}
        self.pins = Pins()
        self.evictable_bytes = 0
        self.evictions = 0
        self.calls = calls
        self.works = getattr(policy, "records_work", False)  # whether it is told work

    def lookup(self, key: str) -> bool:
        """Lookup: every key is recorded; a hit pins the entry."""
        self.policy.record(key)
        if self.calls is not None:
            self.calls.append((key,))
        if key not in self.entries:
            return False
        if self.pins.pin(key):
            self.order.discard(key)
            self.log("discard", key)
            self.evictable_bytes -= self.entries[key][1]
        return True

    def log(self, step: str, key: str) -> None:
        """Note an order or forget call of the policy's, when logging."""
        if self.calls is not None:
            self.calls.append((step, key))

    def release(self, key: str) -> None:
        if self.pins.release(key):
            self.order.add(key)
            self.log("add", key)
            self.evictable_bytes += self.entries[key][1]

    def begin_load(self, key: str, nbytes: int) -> str | None:
        """BeginLoad: allocate (evicting as the rule allows) and pin; else the reason."""
        allocator = self.allocator
        size = allocator.rounded(nbytes)
        offset = allocator.allocate(size)
        if offset is None:
            if allocator.free_bytes + self.evictable_bytes < size:
                return "no_space"
            entries = self.entries
            window = choose_victims(
                size,
                (Block(*entries[k], False) for k in self.order),
                frag.MAX_BATCH,
                allocator.block_before,
                allocator.block_at,
            )
            if window is None:
                return "no_space"
            victims = [self.by_offset[v] for v in window.victims]
            if self.calls is not None:
                self.calls.append((key, nbytes, victims))
            if not self.policy.admit(key, nbytes, victims):
                return "not_admitted"
            for victim in victims:
                self.evict(victim)
            offset = allocator.allocate(size)
            assert offset == window.offset, (offset, window)
        assert offset is not None
        self.inserted_bytes += size
        self.entries[key] = (offset, size)
        self.by_offset[offset] = key
        self.pins.pin(key)
        return None

    def note_work(self, specs: Sequence[Any]) -> None:
        """The end of a request's insert of its encoded misses (``specs``), each with its
        encoder work (its ``tokens``: token-equivalents, as the real cache is given it):
        ``note_work`` for those now cached, ``note_encoded`` for the others."""
        if not self.works:
            return
        policy: Any = self.policy
        for spec in specs:
            entry = self.entries.get(spec.key)
            cached = entry is not None
            size = entry[1] if cached else self.allocator.rounded(spec.nbytes)
            if self.calls is not None:
                self.calls.append(("work" if cached else "encoded", spec.key, spec.tokens, size))
            (policy.note_work if cached else policy.note_encoded)(spec.key, spec.tokens, size)

    def evict(self, key: str) -> None:
        offset, size = self.entries.pop(key)
        self.order.discard(key)
        self.log("discard", key)
        self.evictable_bytes -= size
        self.evicted_bytes += size
        del self.by_offset[offset]
        self.allocator.free(offset)
        self.policy.forget(key)
        self.log("forget", key)
        self.evictions += 1


def simulate(
    workload: mixes.Workload,
    policy: Policy,
    calls: list[tuple[Any, ...]] | None = None,
    capacity: int = frag.POOL_BYTES,
    second_offer: bool = True,
) -> mixes.Result:
    """Replay ``workload`` as the encode pipeline drives the cache (a pool of ``capacity``
    bytes), with ``policy``: a request looks its items up reserving its misses, encodes every
    miss and inserts them all with their work (a miss refused at lookup is offered again: a
    second BeginLoad, which counts as a second insert, refusal or failure), and its pins go
    when it closes, in the order it looked the keys up, as the cache releases them.
    ``second_offer=False``: what the cache would do if an insert skipped the keys the
    policy refused at its own request's lookup (a miss that found no space is still
    offered again; the work of every encoded output is still told)."""
    result = mixes.Result()
    cache = Simulated(capacity, policy, calls)
    open_requests: deque[list[str]] = deque()
    started = time.perf_counter()
    for indices in workload.requests:
        specs = [workload.specs[i] for i in indices]
        held, misses = set(), []
        for spec in specs:
            result.lookups += 1
            result.lookup_tokens += spec.tokens
            if cache.lookup(spec.key):
                held.add(spec.key)
                result.hits += 1
                result.hit_tokens += spec.tokens
            else:
                misses.append(spec)
        done = set()  # not offered again: reserved, and refused when there is no second offer
        for again in (False, True):  # BeginLoad at lookup, and at insert for the others
            for spec in misses:
                if again and spec.key in done:
                    continue
                result.inserts += 1
                reason = cache.begin_load(spec.key, spec.nbytes)
                if reason is None:
                    held.add(spec.key)
                    done.add(spec.key)
                elif reason == "no_space":
                    result.failed += 1
                else:
                    result.refused += 1
                    if not second_offer:
                        done.add(spec.key)
        cache.note_work(misses)
        open_requests.append([spec.key for spec in specs if spec.key in held])
        if len(open_requests) > workload.inflight:
            for key in open_requests.popleft():
                cache.release(key)
    while open_requests:
        for key in open_requests.popleft():
            cache.release(key)
    assert not cache.pins and len(cache.order) == len(cache.entries)
    cache.allocator.check_invariants()
    result.evictions = cache.evictions
    result.inserted_bytes, result.evicted_bytes = cache.inserted_bytes, cache.evicted_bytes
    result.seconds = time.perf_counter() - started
    return result


def run_real(workload: mixes.Workload, policy: str) -> mixes.Result:
    """Drive a real ``EmbeddingCache(policy=policy)`` as the encode pipeline does: each request
    looks its items up reserving the misses, inserts every miss with its work (its tokens;
    real copies of real-sized tensors) and stays open while the next ``inflight`` requests
    run."""
    result = mixes.Result()
    sources = {
        dtype: torch.empty(mixes.MAX_TOKENS * mixes.HIDDEN, dtype=dtype)
        for dtype in (torch.bfloat16, torch.float32)
    }
    started = time.perf_counter()
    with EmbeddingCache(
        frag.POOL_BYTES,
        alignment=mixes.ALIGN,
        max_eviction_batch=frag.MAX_BATCH,
        pin_memory=False,
        io_workers=1,
        policy=policy,
        auto_fence=None,
    ) as cache:
        open_requests: deque[Request] = deque()
        for n, indices in enumerate(workload.requests):
            specs = [workload.specs[i] for i in indices]
            request = cache.request(f"r{n}")
            statuses = request.lookup([s.item for s in specs], prefetch=False, reserve_misses=True)
            missed = []
            for spec, status in zip(specs, statuses, strict=True):
                result.lookups += 1
                result.lookup_tokens += spec.tokens
                if status.status is Status.HIT:
                    result.hits += 1
                    result.hit_tokens += spec.tokens
                else:
                    missed.append(spec)
            if missed:
                tensors = [
                    sources[s.dtype][: s.tokens * mixes.HIDDEN].view(s.tokens, mixes.HIDDEN)
                    for s in missed
                ]
                keys, work = [s.key for s in missed], [float(s.tokens) for s in missed]
                request.insert(keys, tensors, publish=False, work=work)
            open_requests.append(request)
            if len(open_requests) > workload.inflight:
                open_requests.popleft().close()
        while open_requests:
            open_requests.popleft().close()
        cache.check_invariants()
        stats = cache.stats()
        assert stats.hits == result.hits and stats.pinned_entries == 0
        result.refused = stats.admissions_refused
        result.failed = sum(stats.allocation_failures_by_reason.values()) - result.refused
        result.inserts = stats.inserts + result.failed + result.refused
        result.evictions = stats.evictions
    result.seconds = time.perf_counter() - started
    return result


def checked_real(workload: mixes.Workload, policy: str) -> mixes.Result:
    """``run_real``, and the simulation of the same policy, which must agree with it exactly
    (hits, tokens saved, refusals, failures, evictions): the candidates run only simulated."""
    real = run_real(workload, policy)
    simulated = simulate(workload, make_policy(policy))
    fields = ("hits", "hit_tokens", "refused", "failed", "evictions")
    if any(getattr(real, f) != getattr(simulated, f) for f in fields):
        raise AssertionError(
            f"the simulation of {policy!r} departs from the real cache: "
            + ", ".join(f"{f} {getattr(real, f)} vs {getattr(simulated, f)}" for f in fields)
        )
    return real


def from_tally(tally: frag.Tally) -> mixes.Result:
    """A baseline's tally as a ``mixes.Result``."""
    return mixes.Result(
        lookups=tally.lookups,
        hits=tally.hits,
        lookup_tokens=tally.lookup_tokens,
        hit_tokens=tally.hit_tokens,
        inserts=tally.attempts,
        failed=tally.failures,
        evictions=tally.evictions,
        evicted_bytes=tally.evicted_bytes,
        inserted_bytes=tally.inserted_bytes,
        seconds=tally.seconds,
    )


def measure(quick: bool) -> dict[str, dict[str, mixes.Result]]:
    """Results[mix][contender]: the baselines, then ``CONTENDERS``. ``REAL`` contenders run
    through the real cache (checked against the simulation); with ``quick``, every contender
    is simulated and the check runs on the first ``QUICK_CHECK`` requests of the scan mix."""
    if quick:
        check = make_mix("scan", quick)
        check.requests[:] = check.requests[:QUICK_CHECK]
        for name in REAL:
            checked_real(check, name)
    out: dict[str, dict[str, mixes.Result]] = {}
    for mix in MIXES:
        workload = make_mix(mix, quick)
        results = {mode: from_tally(frag.run_baseline(workload, mode)) for mode in frag.BASELINES}
        results[bench_paged.MODE] = from_tally(bench_paged.run_paged(workload))
        for name, make in CONTENDERS.items():
            if name in REAL and not quick:
                results[name] = checked_real(workload, name)
            else:
                results[name] = simulate(workload, make())
        out[mix] = results
    return out


# ---------------------------------------------------------------------------- cost
def replay(policy: Any, calls: list[tuple[Any, ...]]) -> float:
    """Seconds to make ``calls`` (``Simulated``'s log) on ``policy`` and its own order."""
    order = policy.order()
    record, admit = policy.record, policy.admit
    steps = {"add": order.add, "discard": order.discard, "forget": policy.forget}
    started = time.thread_time()
    for call in calls:
        if len(call) == 1:
            record(call[0])
        elif len(call) == 3:
            admit(*call)
        elif len(call) == 4:
            getattr(policy, "note_" + call[0])(*call[1:])
        else:
            steps[call[0]](call[1])
    return time.thread_time() - started


def cost_row(quick: bool, policy: str = CHOSEN) -> dict[str, Any]:
    """What ``policy``'s record + admit add to LRU's (the same calls replayed on both, with
    the order's add and discard and forget, so that the keys the cache holds are resident),
    per looked-up item, against a hit's cost per item in an 8-item all-hit request through
    the real cache. Chunks alternate; medians."""
    calls: list[tuple[Any, ...]] = []
    simulate(make_mix("steady", quick), make_policy(policy), calls)
    lookups = sum(len(call) == 1 for call in calls)
    chunks = 5 if quick else 15
    with contextlib.ExitStack() as stack:
        (hit, _, _), batches = bench_hitpath.contenders(stack, 1000, 200 * chunks)
        for n, batch in enumerate(batches[:50]):  # warm up
            hit(n, batch)
        added_us, hit_us = [], []
        for c in range(chunks):
            chosen, lru = replay(make_policy(policy), calls), replay(make_policy("lru"), calls)
            added_us.append(1e6 * (chosen - lru) / lookups)
            chunk = batches[c * 200 : (c + 1) * 200]
            started = time.thread_time()
            for n, batch in enumerate(chunk):
                hit(n, batch)
            hit_us.append(1e6 * (time.thread_time() - started) / (200 * bench_hitpath.BATCH))
    ours, base = statistics.median(added_us), statistics.median(hit_us)
    return make_row(
        f"{policy} record+admit over lru's, per item, vs a hit",
        ours,
        base,
        "us/item",
        ours / base,
        "<= 0.1",
        ours / base <= 0.1,
    )


def hit_request_row(
    quick: bool, entries: int = 1000, policy: str = CHOSEN, made: Policy | None = None
) -> dict[str, Any]:
    """An 8-item all-hit request (lookup, views, close) per item through a cache with the
    chosen policy (``made``, when given, under the name ``policy``) against one with LRU: the
    whole request, where ``record`` runs per item. Chunks alternate; medians, and the ratio is
    the median of the ratios of adjacent chunks (robust to the load of a shared machine, which
    comes and goes between chunks)."""
    batch = bench_hitpath.BATCH
    items = [Item(f"img{i:08d}", bench_hitpath.SHAPE, torch.bfloat16) for i in range(entries)]
    rng = random.Random(entries)
    chunks, per_chunk = (40, 50) if quick else (100, 100)
    batches = [[rng.choice(items) for _ in range(batch)] for _ in range(chunks * per_chunk)]
    source = torch.zeros(bench_hitpath.SHAPE, dtype=torch.bfloat16)
    times: dict[str, list[float]] = {policy: [], "lru": []}
    with contextlib.ExitStack() as stack:
        caches = {}
        for name in times:
            cache = stack.enter_context(
                EmbeddingCache(
                    entries * bench_hitpath.ENTRY_BYTES,
                    alignment=bench_hitpath.ENTRY_BYTES,
                    pin_memory=False,
                    io_workers=1,
                    policy=made if made is not None and name == policy else name,
                    auto_fence=None,
                )
            )
            with cache.request("fill") as fill:
                insert_all(fill, [it.key for it in items], source)
            caches[name] = cache

        def serve(cache: EmbeddingCache, chunk: list[list[Item]]) -> float:
            started = time.thread_time()
            for n, keys in enumerate(chunk):
                with cache.request(f"r{n}") as request:
                    statuses = request.lookup(keys, prefetch=False)
                    request.embeddings()
                assert statuses[0].status is Status.HIT
            return 1e6 * (time.thread_time() - started) / (len(chunk) * batch)

        for cache in caches.values():  # warm up
            serve(cache, batches[:50])
        for c in range(chunks):
            chunk = batches[c * per_chunk : (c + 1) * per_chunk]
            for name in (policy, "lru") if c % 2 else ("lru", policy):
                times[name].append(serve(caches[name], chunk))
    ours, base = statistics.median(times[policy]), statistics.median(times["lru"])
    ratio = statistics.median(a / b for a, b in zip(times[policy], times["lru"], strict=True))
    return make_row(
        f"all-hit request per item, policy {policy} vs lru",
        ours,
        base,
        "us/item",
        ratio,
        "<= 1.1",
        ratio <= 1.1,
    )


# ---------------------------------------------------------------------------- rows
def rows_of(results: dict[str, dict[str, mixes.Result]]) -> list[dict[str, Any]]:
    """Target rows (the chosen policy's tokens saved against each baseline and our LRU, per
    mix) and context rows: the candidates' tokens saved, everyone's hit ratio against our
    LRU's, failed inserts and refusals where there are any (and always the chosen policy's):
    with our LRU's row (0 failed, 0 refused on every mix), the whole table."""
    rows = []
    for mix, by_name in results.items():
        chosen, lru = by_name[CHOSEN], by_name["lru"]
        for name in (*frag.BASELINES, bench_paged.MODE, "lru"):
            base = by_name[name].tokens_saved
            margin = LRU_MARGIN if name == "lru" and mix in ("steady", "scan") else 0.0
            target = f">= baseline + {margin:g}" if margin else ">= baseline"
            rows.append(
                make_row(
                    f"{mix}: tokens saved, {CHOSEN} vs {name}",
                    chosen.tokens_saved,
                    base,
                    "%",
                    chosen.tokens_saved / base,
                    target,
                    chosen.tokens_saved >= base + margin,
                )
            )
        for name, result in by_name.items():
            if name in CONTENDERS and name not in (CHOSEN, "lru"):
                rows.append(
                    make_row(
                        f"{mix}: tokens saved, {name} vs lru",
                        result.tokens_saved,
                        lru.tokens_saved,
                        "%",
                        result.tokens_saved / lru.tokens_saved,
                        "",
                        None,
                    )
                )
        others = [name for name in by_name if name != "lru"]
        for name in others:
            result = by_name[name]
            rows.append(
                make_row(
                    f"{mix}: hit ratio, {name} vs lru",
                    result.hit_ratio,
                    lru.hit_ratio,
                    "%",
                    result.hit_ratio / lru.hit_ratio,
                    "",
                    None,
                )
            )
        for name in others:  # those that fail or refuse inserts, and the chosen policy
            result = by_name[name]
            if result.failed or name == CHOSEN:
                rows.append(
                    make_row(
                        f"{mix}: failed inserts, {name} vs lru",
                        result.failed,
                        lru.failed,
                        "inserts",
                        result.failed / lru.failed if lru.failed else None,
                        "",
                        None,
                    )
                )
            if result.refused or name == CHOSEN:
                rows.append(
                    make_row(
                        f"{mix}: refused inserts (not admitted), {name}",
                        result.refused,
                        None,
                        "inserts",
                        None,
                        "",
                        None,
                    )
                )
    return rows


def table(results: dict[str, dict[str, mixes.Result]]) -> str:
    """The whole table, contender x mix: tokens saved, hit ratio, failed inserts, refusals."""
    names = list(next(iter(results.values())))
    head = f"{'contender':28}" + "".join(f" | {mix:>27}" for mix in results)
    lines = [
        head,
        f"{'':28}" + " | tokens%  hits%  failed refused" * len(results),
        "-" * len(head),
    ]
    for name in names:
        cells = "".join(
            f" | {r.tokens_saved:7.1f} {r.hit_ratio:6.1f} {r.failed:7d} {r.refused:7d}"
            for r in (results[mix][name] for mix in results)
        )
        lines.append(f"{name:28}{cells}")
    return "\n".join(lines)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows ``{name, ours, baseline, unit, ratio, target, met}`` for ``benchmarks/run.py``."""
    costs = [row(quick, policy=name) for name in COSTED for row in (cost_row, hit_request_row)]
    return [*rows_of(measure(quick)), *costs]


# ---------------------------------------------------------------------------- plot
def plot(plt: Any, rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Tokens saved per mix: every baseline, our LRU, the candidates and the chosen policy."""
    values: dict[str, dict[str, float]] = {}
    for row in rows:
        mix, sep, rest = row["name"].partition(": tokens saved, ")
        if not sep or row["ours"] is None or mix.startswith("grid "):  # bench_policy_grid's
            continue
        name, _, base = rest.partition(" vs ")
        values.setdefault(mix, {})[base] = row["baseline"]
        values[mix][name] = row["ours"]
    if not values:
        return None
    mixes = list(values)
    names = [n for n in values[mixes[0]] if n != CHOSEN] + [CHOSEN]
    others = iter(["0.8", "0.65", "0.5", "C0", "C2", "C4", "C1", "C5", "C6"])  # C3 is ours
    colors = {name: "C3" if name == CHOSEN else next(others, None) for name in names}
    fig, ax = plt.subplots(figsize=(9.6, 4.8), dpi=100)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(
            [m + i * width for m in range(len(mixes))],
            [values[mix].get(name, 0.0) for mix in mixes],
            width,
            label=name,
            color=colors[name],
        )
    top = max(v for by_name in values.values() for v in by_name.values())
    ax.set_xticks([m + width * (len(names) - 1) / 2 for m in range(len(mixes))])
    ax.set_xticklabels(mixes)
    ax.set(
        title="Encoder tokens saved, per request mix (1 GiB pool; grey: first fit and paged)",
        xlabel="request mix",
        ylabel="tokens served from the cache (%)",
        ylim=(0, top * 1.3),
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncol=4, loc="upper center")
    fig.tight_layout()
    path = out / "policy.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def check_real(policies: Sequence[str], requests: int) -> dict[str, dict[str, Any]]:
    """Each policy through the real cache and the simulation on the first ``requests``
    requests of the quick scan mix (``checked_real``: raises if they depart): the real run's
    counts, by policy."""
    out = {}
    for policy in policies:
        workload = make_mix("scan", quick=True)
        workload.requests[:] = workload.requests[:requests]
        out[policy] = dataclasses.asdict(checked_real(workload, policy))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write DIR/policy.png")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the rows as a JSON list")
    parser.add_argument(
        "--check-real",
        nargs="+",
        metavar="POLICY",
        help="only check the simulation against the real cache for these policies",
    )
    parser.add_argument(
        "--requests", type=int, default=QUICK_CHECK, help="requests of --check-real's run"
    )
    args = parser.parse_args()
    if args.check_real:
        counts = check_real(args.check_real, args.requests)
        print(json.dumps(counts, indent=1))
        if args.json is not None:
            args.json.write_text(json.dumps(counts, indent=1) + "\n")
        raise SystemExit(0)
    results = measure(args.quick)
    print(table(results))
    print()
    costs = [row(args.quick, policy=p) for p in COSTED for row in (cost_row, hit_request_row)]
    rows = [*rows_of(results), *costs]
    print_rows(rows)
    if args.json is not None:
        args.json.write_text(json.dumps([json_row(r) for r in rows], indent=1) + "\n")
    if args.plot is not None:
        from benchmarks.common import require_matplotlib

        args.plot.mkdir(parents=True, exist_ok=True)
        print(plot(require_matplotlib(), rows, args.plot))
