"""The request mixes the fragmentation and policy benchmarks run, and what the checks of them
need: a catalogue of vision-encoder outputs (``Spec``: 64..4096 tokens, log-uniform, x 3584
hidden; 70% bf16, 30% fp32) requested 1-3 distinct images at a time with Zipf(0.9) popularity,
optionally drifting (``make_workload``); ``SmallSpec``, an entry of a few bytes a token (the
small pools' catalogue); ``Result``, what one contender did on one mix; and ``optimum``, the
offline optimum on one (Belady on bytes), the reference the eviction policies are judged
against. Used by ``benchmarks/micro/bench_fragmentation.py``, ``bench_paged.py`` and
``benchmarks/policy/``, and by the tests that check them.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import torch

from embcache import Item

HIDDEN = 3584
MIN_TOKENS, MAX_TOKENS = 64, 4096
ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


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
    rng = random.Random(seed)
    universe = 600 if quick else 1500
    specs = [
        Spec(
            f"img{i}",
            round(math.exp(rng.uniform(math.log(MIN_TOKENS), math.log(MAX_TOKENS)))),
            torch.bfloat16 if rng.random() < 0.7 else torch.float32,
        )
        for i in range(universe)
    ]
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(universe)]
    requests = []
    for _ in range(300 if quick else 2000):
        chosen: list[int] = []
        want = rng.randint(1, 3)
        while len(chosen) < want:
            index = rng.choices(range(universe), weights)[0]
            if index not in chosen:
                chosen.append(index)
        requests.append(chosen)
    if drifting:
        shuffler, owner = random.Random(seed + 1), list(range(universe))
        for n, chosen in enumerate(requests):
            if n % drift_every(quick) == 0:
                shuffler.shuffle(owner)
            chosen[:] = [owner[rank] for rank in chosen]
    return Workload(specs, requests, inflight=4)


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


def optimum(load: Workload, capacity: int) -> Result:
    """Belady on bytes (contiguity and pins ignored): on a miss, evict the entries whose next
    lookup is furthest away until the candidate fits, unless the candidate's own next lookup is
    further than theirs (then it is not cached). O(lookups log entries)."""
    lookups = [index for request in load.requests for index in request]
    never = len(lookups)
    upcoming = [never] * len(lookups)
    last: dict[int, int] = {}
    for position in range(len(lookups) - 1, -1, -1):
        upcoming[position] = last.get(lookups[position], never)
        last[lookups[position]] = position
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
