"""Cost of one allocation that needs eviction, with the oldest half of the entries pinned.

The pool holds exactly N entries of 256 bytes, so every new insert must evict one. The oldest
N/2 entries are pinned by a request that stays open (a long prefill, say); the newer N/2 are
idle. Each timed operation is one request that inserts one fresh key (evicting the oldest idle
entry) and closes, which appends its entry to the LRU tail: a steady state.

Ours is ``EmbeddingCache`` through its public API: its LRU list holds only evictable entries
(DESIGN.md), so pinned entries are never looked at. The baseline (``ScanLRUCache``, in
``tests/support/baselines.py``) is the design it replaces: one recency list of every entry, scanned
from the head past pinned entries until an idle one is found; it uses the same ``RangeAllocator``
and the same payload copy, so the difference is the victim search. Every configuration is built
first (each N with half pinned, and the largest N again with none pinned), then timed in chunks
that alternate over all of them, so that load drift on a shared machine hits them alike; medians.
The target, a cost independent of the number of pinned entries, is judged twice: at the largest N,
the cost with N/2 pinned over the cost with none pinned (<= 1.5x), and the cost at the largest N
over the smallest (<= 3x, the allocator being O(log n)). The same evicting insert also runs against
SGLang 0.5.23's paged controller, from its wheel, with 256 B pages (one entry a page):
``benchmarks.peers.bench_peers.sglang_evicting_side``; target: ours at least as fast at every N.
SGLang's insert opens no request, so ours is timed against it twice: the request above, and
``cache.insert`` (the request-less insert, as SGLang's ``store_to_pool_async`` is called) into
the same kind of full pool.
Run from the repository root: python -m benchmarks.micro.bench_eviction [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import growth_row, insert_all, make_row, print_rows, skipped_row
from benchmarks.peers import bench_peers
from embcache import EmbeddingCache
from tests.support.baselines import ScanLRUCache

ENTRY_BYTES = 256
SHAPE = (ENTRY_BYTES // 2,)  # bf16
FLAT_PINNED = 1.5  # cost with N/2 pinned over cost with none pinned, at the same N
FLAT_GROWTH = 3.0  # cost at the largest N over the smallest (the allocator is O(log n))


class Side:
    """One contender in one configuration: its timed operation, and how many per chunk."""

    def __init__(self, op: Callable[[int], None], ops: int) -> None:
        self.op = op
        self.ops = ops
        self.next = 0
        self.times: list[float] = []

    def chunk(self, ops: int | None = None) -> float:
        """Seconds per operation over ``ops`` (default: its own count) operations."""
        ops = self.ops if ops is None else ops
        start = time.perf_counter()
        for _ in range(ops):
            self.op(self.next)
            self.next += 1
        return (time.perf_counter() - start) / ops

    def median(self) -> float:
        return statistics.median(self.times)


def ours_side(
    stack: contextlib.ExitStack,
    entries: int,
    pinned: bool,
    tensor: torch.Tensor,
    ops: int,
    request_less: bool = False,
) -> Side:
    """A full cache of ``entries``; the oldest half pinned by an open request if ``pinned``.
    The op inserts a fresh key in a request of its own, or by ``cache.insert`` if
    ``request_less``."""
    cache = stack.enter_context(
        EmbeddingCache(  # lru: each insert evicts the oldest idle entry, as SGLang's controller
            entries * ENTRY_BYTES,
            alignment=ENTRY_BYTES,
            pin_memory=False,
            io_workers=1,
            policy="lru",
        )
    )
    stack.callback(cache.check_invariants)  # runs before the cache closes
    half = entries // 2
    oldest = stack.enter_context(cache.request("oldest-half"))
    insert_all(oldest, [f"old{i}" for i in range(half)], tensor)
    if not pinned:
        oldest.close()
    with cache.request("newer-half") as newer:
        insert_all(newer, [f"new{i}" for i in range(half, entries)], tensor)
    stats = cache.stats()
    assert stats.free_bytes == 0 and stats.pinned_entries == (half if pinned else 0)

    def op(n: int) -> None:
        with cache.request(f"e{n}") as request:
            assert request.insert([f"fresh{n}"], [tensor], publish=False) == [True]

    def insert(n: int) -> None:
        assert cache.insert([f"fresh{n}"], [tensor], publish=False) == [True]

    return Side(insert if request_less else op, ops)


def baseline_side(entries: int, pinned: bool, tensor: torch.Tensor, ops: int) -> Side:
    cache = ScanLRUCache(entries * ENTRY_BYTES)
    half = entries // 2
    for i in range(half):
        assert cache.insert(f"old{i}", tensor)
        if not pinned:
            cache.release(f"old{i}")
    for i in range(half, entries):
        assert cache.insert(f"new{i}", tensor)
        cache.release(f"new{i}")

    def op(n: int) -> None:
        key = f"fresh{n}"
        assert cache.insert(key, tensor)
        cache.release(key)

    return Side(op, ops)


def measure(sides: list[Side], chunks: int) -> None:
    """Chunks alternate over every side (so load drift hits them alike); fills ``times``."""
    for side in sides:  # warm up
        side.chunk(max(1, side.ops // 10))
    for _ in range(chunks):
        for side in sides:
            side.times.append(side.chunk())


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Per N: us per evicting insert, ours vs the scanning baseline (ratio = speedup); at the
    largest N: cost with N/2 pinned over cost with none pinned; growth over N."""
    sizes = [1_000, 10_000] if quick else [1_000, 10_000, 100_000]
    largest = sizes[-1]
    tensor = torch.zeros(SHAPE, dtype=torch.bfloat16)
    chunks = 5 if quick else 7
    ours_ops = 200 if quick else 400  # a steady state: each op's entry becomes idle again

    def base_ops(entries: int) -> int:  # it scans entries/2 pinned entries per op: bound it
        return max(2, min(ours_ops, (200_000 if quick else 1_000_000) // entries))

    why = bench_peers.sglang_missing()
    with contextlib.ExitStack() as stack:
        ours = {n: ours_side(stack, n, True, tensor, ours_ops) for n in sizes}
        base = {n: baseline_side(n, True, tensor, base_ops(n)) for n in sizes}
        ours_free = ours_side(stack, largest, False, tensor, ours_ops)
        base_free = baseline_side(largest, False, tensor, base_ops(largest))
        sglang, bare = {}, {}
        if why is None:
            sglang = {n: Side(bench_peers.sglang_evicting_side(n, tensor), ours_ops) for n in sizes}
            bare = {n: ours_side(stack, n, True, tensor, ours_ops, True) for n in sizes}
        sides = [*ours.values(), *base.values(), ours_free, base_free]
        measure([*sides, *sglang.values(), *bare.values()], chunks)
    rows = []
    for n in sizes:
        ours_t, base_t = ours[n].median(), base[n].median()
        rows.append(
            make_row(
                f"evicting insert, {n} entries, half pinned",
                ours_t * 1e6,
                base_t * 1e6,
                "us/op",
                base_t / ours_t,
                "",
                None,
            )
        )
    for n in sizes:
        name = f"evicting insert, {n} entries, half pinned, vs {bench_peers.SGLANG}"
        if why is not None:
            rows.append(skipped_row(name, why, ">= 1.0x"))
            rows.append(skipped_row(name.replace("insert", "cache.insert"), why, ">= 1.0x"))
            continue
        peer_t = sglang[n].median()
        for label, side in ((name, ours[n]), (name.replace("insert", "cache.insert"), bare[n])):
            ours_t = side.median()
            ratio, ok = peer_t / ours_t, peer_t >= ours_t
            rows.append(make_row(label, ours_t * 1e6, peer_t * 1e6, "us/op", ratio, ">= 1.0x", ok))
    pinned_over_free = ours[largest].median() / ours_free.median()
    rows.append(
        make_row(
            f"evicting insert, {largest} entries, {largest // 2} pinned / 0 pinned",
            pinned_over_free,
            base[largest].median() / base_free.median(),
            "x",
            pinned_over_free,
            f"<= {FLAT_PINNED}x",
            pinned_over_free <= FLAT_PINNED,
        )
    )
    rows.append(
        growth_row(
            "evicting insert", sizes, {n: ours[n].median() for n in sizes}, "entries", FLAT_GROWTH
        )
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
