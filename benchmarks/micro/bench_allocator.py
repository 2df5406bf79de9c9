"""Allocate+free pair cost vs live blocks: RangeAllocator against the naive first-fit baseline,
and against a minimal best fit (``tests.support.baselines.MinimalBestFit``).

Against first fit, the pool is fragmented first: 2N blocks of mixed sizes, every other one
freed, so N live blocks and about N free holes. Each pair allocates a random size and frees it
again. Against the minimal best fit (the same policy at its barest, so the same offsets), N
blocks of 1..8 units fill the pool and a random half of them is freed (N/4 free fragments once
coalesced); the same pairs run on both, in chunks that alternate between them; medians. Target:
within 1.1x of the minimal best fit.
Run: python -m benchmarks.micro.bench_allocator [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Protocol

from benchmarks.common import growth_row, make_row, print_rows
from embcache.driver.allocator import RangeAllocator
from tests.support.baselines import MinimalBestFit, NaiveAllocator, half_freed

ALIGN = 256
BEST_FIT_SLACK = 1.1  # ours may cost this much more than the minimal best fit


class Allocator(Protocol):
    def allocate(self, nbytes: int) -> int | None: ...
    def free(self, offset: int) -> int: ...


def fragmented(make: Any, live: int, seed: int) -> Allocator:
    rng = random.Random(seed)
    sizes = [ALIGN * rng.randint(1, 8) for _ in range(2 * live)]
    alloc = make(sum(sizes) + 64 * ALIGN * 8, ALIGN)
    offsets = [alloc.allocate(s) for s in sizes]
    if isinstance(alloc, NaiveAllocator):  # its free() is O(n log n): build the same holes directly
        holes = {off: alloc.allocated.pop(off) for off in offsets[::2]}
        tail = alloc.free_list[-1]
        alloc.free_list = [[o, s] for o, s in sorted(holes.items())]
        if tail[0] == max(holes) + holes[max(holes)]:
            alloc.free_list[-1][1] += tail[1]
        else:
            alloc.free_list.append(tail)
    else:
        for off in offsets[::2]:
            alloc.free(off)
    return alloc


def pair_cost(alloc: Allocator, pairs: int, seed: int) -> float:
    """Seconds per allocate+free pair."""
    rng = random.Random(seed)
    sizes = [ALIGN * rng.randint(1, 8) for _ in range(pairs)]
    start = time.perf_counter()
    for size in sizes:
        off = alloc.allocate(size)
        assert off is not None
        alloc.free(off)
    return (time.perf_counter() - start) / pairs


def best_fit_rows(quick: bool) -> list[dict[str, Any]]:
    """Per N in (1k, 100k): us per pair, ours vs the minimal best fit (ratio = speedup)."""
    rows = []
    pairs, chunks = (2_000, 5) if quick else (10_000, 9)
    for live in (1_000, 100_000):
        ours_alloc = half_freed(RangeAllocator, live, seed=live)
        base_alloc = half_freed(MinimalBestFit, live, seed=live)
        fragments = len(ours_alloc.free_blocks())  # type: ignore[attr-defined]
        assert fragments == len(base_alloc.by_offset)  # type: ignore[attr-defined]
        times: tuple[list[float], list[float]] = ([], [])
        for chunk in range(chunks + 1):  # the first chunk warms up
            for side, alloc in enumerate((ours_alloc, base_alloc)):
                cost = pair_cost(alloc, pairs, seed=chunk)
                if chunk:
                    times[side].append(cost)
        ours, base = statistics.median(times[0]), statistics.median(times[1])
        rows.append(
            make_row(
                f"allocator pair vs minimal best fit, {live} blocks, {fragments} free",
                ours * 1e6,
                base * 1e6,
                "us/pair",
                base / ours,
                f">= {1 / BEST_FIT_SLACK:.2f}x",
                base / ours >= 1 / BEST_FIT_SLACK,
            )
        )
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows ``{name, ours, baseline, unit, ratio, target, met}`` for 1k, 10k and 100k blocks
    against first fit, then for 1k and 100k blocks against the minimal best fit."""
    sizes = [1_000, 10_000] if quick else [1_000, 10_000, 100_000]
    rows, ours_at = [], {}
    for live in sizes:
        ours_alloc = fragmented(RangeAllocator, live, seed=live)
        naive_alloc = fragmented(NaiveAllocator, live, seed=live)
        ours = pair_cost(ours_alloc, 20_000 if not quick else 2_000, seed=1)
        naive = pair_cost(naive_alloc, max(10, 2_000_000 // live // (10 if quick else 1)), seed=1)
        ours_at[live] = ours
        ratio = naive / ours
        target = 300.0 if live == 100_000 else None
        rows.append(
            {
                "name": f"allocator pair, {live} live blocks",
                "ours": ours * 1e6,
                "baseline": naive * 1e6,
                "unit": "us/pair",
                "ratio": ratio,
                "target": ">= 300x" if target else "",
                "met": (ratio >= target) if target else None,
            }
        )
    rows.append(growth_row("allocator", sizes, ours_at, "blocks", 3.0))
    return rows + best_fit_rows(quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
