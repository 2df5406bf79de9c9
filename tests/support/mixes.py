"""The request mixes the fragmentation and policy benchmarks run, and what the checks of them
need: a catalogue of vision-encoder outputs (``Spec``: 64..4096 tokens, log-uniform, x 3584
hidden; 70% bf16, 30% fp32) requested 1-3 distinct images at a time with Zipf(0.9) popularity,
optionally drifting (``make_workload``), or any mix of the policy grid (``zipf_workload``: skew,
drift period, scans); ``SmallSpec``, an entry of a few bytes a token (the
small pools' catalogue); ``Result``, what one contender did on one mix; and ``optimum``, the
offline optimum on one (Belady on bytes), the reference the eviction policies are judged
against. Used by ``benchmarks/micro/bench_fragmentation.py``, ``bench_paged.py`` and
``benchmarks/policy/``, and by the tests that check them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass

import torch

from embcache import Item
from tests.support.helpers import aligned

HIDDEN = 3584
MIN_TOKENS, MAX_TOKENS = 64, 4096
ALIGN = 256  # the alignment of the benchmarks' pools (`aligned`'s default)


@dataclass(frozen=True)
class Spec:
    """One image's embedding: ``tokens`` x ``HIDDEN`` of ``dtype``."""

    key: str
    tokens: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.tokens * HIDDEN * self.dtype.itemsize

    @property
    def item(self) -> Item:
        return Item(self.key, (self.tokens, HIDDEN), self.dtype)


@dataclass(frozen=True)
class Workload:
    specs: list[Spec]
    requests: list[list[int]]  # indices into specs, distinct within a request
    inflight: int  # requests held open (pinned) at once


def drift_every(quick: bool) -> int:
    """Requests between two reshuffles of the popularity ranking in the drifting variant."""
    return 100 if quick else 500


def make_workload(quick: bool, seed: int = 7, drifting: bool = False) -> Workload:
    """Log-uniform token counts, 70% bf16, Zipf(0.9) popularity, 1-3 images per request.
    ``drifting``: the same draws, but which image holds each popularity rank is reshuffled
    every ``drift_every(quick)`` requests."""
    return zipf_workload(
        seed,
        universe=600 if quick else 1500,
        requests=300 if quick else 2000,
        period=drift_every(quick) if drifting else None,
    )


def zipf_workload(
    seed: int,
    universe: int,
    requests: int,
    skew: float = 0.9,
    period: int | None = None,
    scan_every: int | None = None,
    token_bytes: int | None = None,
) -> Workload:
    """Every mix of the fragmentation and policy benchmarks, drawn from ``seed``: a catalogue
    of ``universe`` images (``Spec``: log-uniform tokens, 70% bf16; ``SmallSpec`` of
    ``token_bytes`` a token when given), then ``requests`` requests of 1-3 distinct images
    with Zipf(``skew``) popularity. ``period``: which image holds each popularity rank is
    reshuffled every ``period`` requests (drift). ``scan_every``: every ``scan_every``-th
    request is instead one new image, seen once (a scan)."""
    rng, shuffler = random.Random(seed), random.Random(seed + 1)
    specs = [_spec(f"img{i}", rng, token_bytes) for i in range(universe)]
    weights = [1.0 / (rank + 1) ** skew for rank in range(universe)]
    cumulative = list(itertools.accumulate(weights))
    owner = list(range(universe))  # which image holds each popularity rank
    out: list[list[int]] = []
    for n in range(requests):
        if period is not None and n % period == 0:
            shuffler.shuffle(owner)
        if scan_every is not None and n % scan_every == scan_every - 1:
            specs.append(_spec(f"scan{n}", rng, token_bytes))
            out.append([len(specs) - 1])
            continue
        chosen: list[int] = []
        want = rng.randint(1, 3)
        while len(chosen) < want:
            image = owner[rng.choices(range(universe), cum_weights=cumulative)[0]]
            if image not in chosen:
                chosen.append(image)
        out.append(chosen)
    return Workload(specs, out, inflight=4)


def _spec(key: str, rng: random.Random, token_bytes: int | None) -> Spec:
    tokens = round(math.exp(rng.uniform(math.log(MIN_TOKENS), math.log(MAX_TOKENS))))
    dtype = torch.bfloat16 if rng.random() < 0.7 else torch.float32
    if token_bytes is None:
        return Spec(key, tokens, dtype)
    return SmallSpec(key, tokens, dtype, token_bytes)


@dataclass(frozen=True)
class SmallSpec(Spec):
    """An entry of ``tokens`` x ``token_bytes`` bytes (the 4 MiB pool's catalogue)."""

    token_bytes: int = 14

    @property
    def nbytes(self) -> int:
        return self.tokens * self.token_bytes


@dataclass
class Result:
    """What one contender did on one mix."""

    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    failed: int = 0  # no run of free blocks and victims fits (or too few bytes idle)
    refused: int = 0  # not admitted by the policy
    evictions: int = 0
    inserted_bytes: int = 0  # of the inserts that took a range
    evicted_bytes: int = 0
    seconds: float = 0.0

    @property
    def tokens_saved(self) -> float:
        return 100 * self.hit_tokens / self.lookup_tokens

    @property
    def hit_ratio(self) -> float:
        return 100 * self.hits / self.lookups


def next_uses(load: Workload) -> tuple[list[int], list[int]]:
    """Every lookup of ``load`` in order (an index into ``specs``), and for each the position
    of the next lookup of the same image (``len(lookups)``: never again)."""
    lookups = [index for request in load.requests for index in request]
    upcoming = [len(lookups)] * len(lookups)
    last: dict[int, int] = {}
    for position in range(len(lookups) - 1, -1, -1):
        upcoming[position] = last.get(lookups[position], len(lookups))
        last[lookups[position]] = position
    return lookups, upcoming


def optimum(load: Workload, capacity: int) -> Result:
    """Belady on bytes (contiguity and pins ignored): on a miss, evict the entries whose next
    lookup is furthest away until the candidate fits, unless the candidate's own next lookup is
    further than theirs (then it is not cached). O(lookups log entries)."""
    lookups, upcoming = next_uses(load)
    never = len(lookups)
    result = Result()
    resident: dict[int, int] = {}  # image -> its next lookup
    furthest: list[tuple[int, int]] = []  # (-next lookup, image); stale pairs skipped
    used = 0
    for position, index in enumerate(lookups):
        item = load.specs[index]
        size = aligned(item.nbytes)
        result.lookups += 1
        result.lookup_tokens += item.tokens
        following = upcoming[position]
        if index in resident:
            result.hits += 1
            result.hit_tokens += item.tokens
            resident[index] = following
            heapq.heappush(furthest, (-following, index))
            continue
        result.inserts += 1
        if following == never or size > capacity:
            continue
        while used + size > capacity:
            later, victim = furthest[0]
            if resident.get(victim) != -later:
                heapq.heappop(furthest)
                continue
            if -later <= following:
                break
            heapq.heappop(furthest)
            del resident[victim]
            used -= aligned(load.specs[victim].nbytes)
            result.evictions += 1
            result.evicted_bytes += aligned(load.specs[victim].nbytes)
        if used + size > capacity:
            result.refused += 1
            continue
        resident[index] = following
        heapq.heappush(furthest, (-following, index))
        used += size
        result.inserted_bytes += size
    return result
