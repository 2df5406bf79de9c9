"""The fragmentation mix against a paged pool: fixed 256 KiB pages, entries spanning pages.

A paged pool never needs contiguous space: an entry takes any ``ceil(bytes / 256 KiB)`` free
pages, so it suffers no external fragmentation, only internal (the last page's tail). It pays
at read time instead: an entry's bytes are scattered, so a reader gathers its pages (a copy)
where ours hands out one zero-copy view of a contiguous range.

``run_paged`` replays the workload of ``benchmarks.micro.bench_fragmentation`` (same requests, same
requests held open, same hits/misses bookkeeping) over such a pool with plain LRU: if the free
pages plus the idle entries' pages cannot hold the entry, nothing is evicted and the allocation
fails; else the oldest idle entries are evicted until enough pages are free, and the entry
takes the victims' pages first (in eviction order), the most favourable choice for this
baseline. ``gather_rows`` measures reading entries of the mix's sizes: ours copies a contiguous
range into the destination; the paged pool gathers the same number of pages, scattered at
random over a 256 MiB pool as after churn (``index_select`` of whole pages).
Run from the repository root: python -m benchmarks.micro.bench_paged [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter, OrderedDict, deque
from typing import Any

import torch

from benchmarks.common import print_rows
from benchmarks.micro import bench_fragmentation as frag
from tests.support import mixes

PAGE = 256 * 1024
MODE = "paged 256 KiB"
GATHER_POOL = 256 << 20


def pages_for(nbytes: int, page: int = PAGE) -> int:
    return -(-nbytes // page)


def run_paged(
    workload: mixes.Workload, pool_bytes: int = frag.POOL_BYTES, page: int = PAGE
) -> frag.Tally:
    """Replay ``workload`` over a paged pool of ``pool_bytes`` (``page`` bytes a page) with
    plain LRU."""
    tally = frag.Tally()
    start = time.perf_counter()
    free_pages = list(range(pool_bytes // page - 1, -1, -1))  # a stack: lowest page on top
    entries: dict[int, list[int]] = {}
    pins: Counter[int] = Counter()
    lru: OrderedDict[int, None] = OrderedDict()  # idle entries, oldest first
    idle_pages = 0
    open_requests: deque[list[int]] = deque()

    def pin(index: int) -> None:
        nonlocal idle_pages
        pins[index] += 1
        if index in lru:
            del lru[index]
            idle_pages -= len(entries[index])

    def release(held: list[int]) -> None:
        nonlocal idle_pages
        for index in held:
            pins[index] -= 1
            if not pins[index]:
                del pins[index]
                lru[index] = None
                idle_pages += len(entries[index])

    for indices in workload.requests:
        held = [i for i in indices if i in entries]
        for index in held:
            pin(index)
        tally.lookups += len(indices)
        tally.hits += len(held)
        tally.lookup_tokens += sum(workload.specs[i].tokens for i in indices)
        tally.hit_tokens += sum(workload.specs[i].tokens for i in held)
        for index in (i for i in indices if i not in entries):
            nbytes = workload.specs[index].nbytes
            need = pages_for(nbytes, page)
            tally.attempts += 1
            if len(free_pages) + idle_pages < need:
                tally.failures += 1
                tally.failures_with_bytes += (len(free_pages) + idle_pages) * page >= nbytes
                continue
            victims: list[tuple[int, list[int]]] = []
            free_before = len(free_pages)
            while len(free_pages) < need:
                victim, _ = lru.popitem(last=False)
                pages = entries.pop(victim)
                idle_pages -= len(pages)
                free_pages.extend(pages)
                victims.append((victim, pages))
            fresh = free_pages[free_before:]  # the victims' pages, in eviction order
            del free_pages[free_before:]
            taken = fresh[:need]  # used first, so that no victim is evicted for nothing
            free_pages.extend(fresh[need:])
            if len(taken) < need:
                extra = need - len(taken)
                taken += free_pages[len(free_pages) - extra :]
                del free_pages[len(free_pages) - extra :]
            used = set(taken)
            tally.evictions += len(victims)
            for _, pages in victims:
                tally.evicted_bytes += len(pages) * page
                if used.isdisjoint(pages):
                    tally.wasted_bytes += len(pages) * page
            entries[index] = taken
            tally.inserted_bytes += need * page
            pin(index)
            held.append(index)
        open_requests.append(held)
        if len(open_requests) > workload.inflight:
            release(open_requests.popleft())
    while open_requests:
        release(open_requests.popleft())
    assert len(free_pages) + idle_pages == pool_bytes // page and not pins
    tally.seconds = time.perf_counter() - start
    return tally


def _ours_values(rows: list[dict[str, Any]] | None, workload: mixes.Workload) -> dict[str, float]:
    """Ours' failed %, fails with bytes idle, wasted MiB and hit % from the fragmentation rows
    of the same run (``bench_fragmentation.run``), or from a fresh run of ours."""
    wanted = {
        "failed": "failed allocations, ",
        "with_bytes": "fails, enough bytes idle, ",
        "wasted": "evicted for nothing, ",
        "evicted": "evicted in all, ",
        "hits": "hit ratio, ",
    }
    found = {}
    for key, prefix in wanted.items():
        for r in rows or []:
            if r["name"].startswith(prefix):
                found[key] = float(r["ours"])
                break
    if len(found) == len(wanted):
        return found
    ours = frag.run_ours(workload)
    return {
        "failed": 100 * ours.failures / ours.attempts,
        "with_bytes": ours.failures_with_bytes,
        "wasted": ours.wasted_bytes / 2**20,
        "evicted": ours.evicted_bytes / 2**20,
        "hits": 100 * ours.hits / ours.lookups,
    }


def gather_rows(workload: mixes.Workload, reads: int, seed: int = 3) -> list[dict[str, Any]]:
    """GB/s reading entries of the mix's sizes: contiguous range copy vs page gather."""
    rng = random.Random(seed)
    sizes = [rng.choice(workload.specs).nbytes for _ in range(reads)]
    pool = torch.ones(GATHER_POOL, dtype=torch.uint8)
    pages_view = pool.view(-1, PAGE)
    destination = torch.empty(pages_for(max(sizes)) * PAGE, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as bench_copy: a shared machine makes 2-thread copies erratic
    ours_rates: list[float] = []
    paged_rates: list[float] = []
    try:
        for n, size in enumerate(sizes):
            count = pages_for(size)
            index = torch.tensor(rng.sample(range(len(pages_view)), count))
            offset = rng.randrange(0, (GATHER_POOL - size) // 256) * 256
            gathered = destination[: count * PAGE].view(count, PAGE)

            def contiguous(offset: int = offset, size: int = size) -> None:
                destination[:size].copy_(pool[offset : offset + size])

            def gather(index: torch.Tensor = index, gathered: torch.Tensor = gathered) -> None:
                torch.index_select(pages_view, 0, index, out=gathered)

            order = (contiguous, gather) if n % 2 else (gather, contiguous)
            for read in order:
                started = time.perf_counter()
                read()
                rate = size / (time.perf_counter() - started) / 1e9
                (ours_rates if read is contiguous else paged_rates).append(rate)
    finally:
        torch.set_num_threads(threads)
    ours, paged = statistics.median(ours_rates), statistics.median(paged_rates)
    return [
        {
            "name": f"read an entry, {MODE} (gather)",
            "ours": ours,
            "baseline": paged,
            "unit": "GB/s",
            "ratio": ours / paged,
            "target": "",
            "met": None,
        }
    ]


def run(
    quick: bool = False, fragmentation_rows: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Rows of ours against the paged pool on the fragmentation mix; pass the rows of
    ``bench_fragmentation.run`` of the same run to reuse its measurement of ours."""
    workload = mixes.make_workload(quick)
    ours = _ours_values(fragmentation_rows, workload)
    paged = frag.check_counts(workload, run_paged(workload))
    paged_hits = 100 * paged.hits / paged.lookups
    return [
        frag.row(
            f"fails, enough bytes idle, {MODE}",
            ours["with_bytes"],
            paged.failures_with_bytes,
            "allocs",
            "",
            None,
        ),
        frag.row(
            f"failed allocations, {MODE}",
            ours["failed"],
            100 * paged.failures / paged.attempts,
            "%",
            "",
            None,
        ),
        frag.row(
            f"evicted for nothing, {MODE}",
            ours["wasted"],
            paged.wasted_bytes / 2**20,
            "MiB",
            "= 0",
            ours["wasted"] == 0,
        ),
        frag.row(
            f"evicted in all, {MODE}", ours["evicted"], paged.evicted_bytes / 2**20, "MiB", "", None
        ),
        frag.row(
            f"hit ratio, {MODE}",
            ours["hits"],
            paged_hits,
            "%",
            ">= baseline",
            ours["hits"] >= paged_hits,
        ),
        *gather_rows(workload, 40 if quick else 200),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
