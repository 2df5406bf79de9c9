"""Cost of one allocation that needs eviction, with the oldest half of the entries pinned.

The pool holds exactly N entries of 256 bytes, so every new insert must evict one. The oldest
N/2 entries are pinned by a request that stays open (a long prefill, say); the newer N/2 are
idle. Each timed operation is one request that inserts one fresh key (evicting the oldest idle
entry) and closes, which appends its entry to the LRU tail: a steady state.

Ours is ``EmbeddingCache`` through its public API: its LRU list holds only evictable entries
(DESIGN.md), so pinned entries are never looked at. The baseline (``ScanLRUCache``, below) is
the design it replaces: one recency list of every entry, scanned from the head past pinned
entries until an idle one is found; it uses the same ``RangeAllocator`` and the same payload
copy, so the difference is the victim search. Both are measured side by side in alternating
chunks, then measured again after the pinning request closes (none pinned, same N): the target
is a cost independent of the number of pinned entries.
Run from the repository root: python -m benchmarks.bench_eviction [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.bench_allocator import print_rows
from embcache import EmbeddingCache, RangeAllocator, Request

ENTRY_BYTES = 256
SHAPE = (ENTRY_BYTES // 2,)  # bf16
FLAT_PINNED = 1.5  # cost with N/2 pinned over cost with none pinned, at the same N
FLAT_GROWTH = 3.0  # cost at the largest N over the smallest (the allocator is O(log n))


def insert_all(request: Request, keys: list[str], tensor: torch.Tensor, chunk: int = 256) -> None:
    """Insert ``tensor`` under every key, in batches: ``insert`` checks each key of a batch
    against the ones before it (quadratic in the batch length)."""
    for start in range(0, len(keys), chunk):
        batch = keys[start : start + chunk]
        assert all(request.insert(batch, [tensor] * len(batch), publish=False))


class ScanLRUCache:
    """Baseline: one recency list of all entries; eviction scans it from the head, skipping
    pinned entries (O(pinned) per victim)."""

    def __init__(self, capacity: int) -> None:
        self.allocator = RangeAllocator(capacity, ENTRY_BYTES)
        self.pool = torch.empty(capacity, dtype=torch.uint8)
        self.entries: dict[str, tuple[int, int]] = {}
        self.pins: Counter[str] = Counter()
        self.recency: OrderedDict[str, None] = OrderedDict()  # every entry, oldest first

    def insert(self, key: str, tensor: torch.Tensor) -> bool:
        """Insert ``key`` pinned (the caller releases it); evict idle entries from the head."""
        size = self.allocator.rounded(tensor.nbytes)
        offset = self.allocator.allocate(size)
        while offset is None:
            victim = next((k for k in self.recency if not self.pins[k]), None)
            if victim is None:
                return False
            del self.recency[victim]
            self.allocator.free(self.entries.pop(victim)[0])
            offset = self.allocator.allocate(size)
        self.pool[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(
            tensor
        )
        self.entries[key] = (offset, size)
        self.recency[key] = None
        self.pins[key] += 1
        return True

    def release(self, key: str) -> None:
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]
            self.recency.move_to_end(key)


class Side:
    """One contender: its fill, its timed operation, and a way to unpin the oldest half."""

    def __init__(self, op: Callable[[int], None], unpin: Callable[[], None]) -> None:
        self.op = op
        self.unpin = unpin
        self.next = 0

    def chunk(self, ops: int) -> float:
        """Seconds per operation over ``ops`` operations."""
        start = time.perf_counter()
        for _ in range(ops):
            self.op(self.next)
            self.next += 1
        return (time.perf_counter() - start) / ops


def ours_side(cache: EmbeddingCache, entries: int, tensor: torch.Tensor) -> Side:
    half = entries // 2
    pinner = cache.request("pinned-oldest-half")
    insert_all(pinner, [f"old{i}" for i in range(half)], tensor)
    with cache.request("idle-newer-half") as idle:
        insert_all(idle, [f"new{i}" for i in range(half, entries)], tensor)
    assert cache.stats().free_bytes == 0

    def op(n: int) -> None:
        with cache.request(f"e{n}") as request:
            assert request.insert([f"fresh{n}"], [tensor], publish=False) == [True]

    holder: list[Request] = [pinner]
    return Side(op, lambda: holder.pop().close())


def baseline_side(entries: int, tensor: torch.Tensor) -> Side:
    cache = ScanLRUCache(entries * ENTRY_BYTES)
    half = entries // 2
    for i in range(half):
        assert cache.insert(f"old{i}", tensor)
    for i in range(half, entries):
        assert cache.insert(f"new{i}", tensor)
        cache.release(f"new{i}")

    def op(n: int) -> None:
        key = f"fresh{n}"
        assert cache.insert(key, tensor)
        cache.release(key)

    def unpin() -> None:
        for i in range(half):
            cache.release(f"old{i}")

    return Side(op, unpin)


def measure(
    ours: Side, base: Side, ours_ops: int, base_ops: int, chunks: int
) -> tuple[float, float]:
    """Median seconds per operation of each, over alternating chunks."""
    ours.chunk(max(1, ours_ops // 10))  # warm up
    base.chunk(1)
    ours_t, base_t = [], []
    for _ in range(chunks):
        ours_t.append(ours.chunk(ours_ops))
        base_t.append(base.chunk(base_ops))
    return statistics.median(ours_t), statistics.median(base_t)


def _row(
    name: str,
    ours: float,
    base: float | None,
    unit: str,
    ratio: float,
    target: str,
    met: bool | None,
) -> dict[str, Any]:
    return {
        "name": name,
        "ours": ours,
        "baseline": base,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "met": met,
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Per N: us per evicting insert, ours vs the scanning baseline (ratio = speedup); at the
    largest N: cost with N/2 pinned over cost with none pinned; growth over N."""
    sizes = [1_000, 10_000] if quick else [1_000, 10_000, 100_000]
    tensor = torch.zeros(SHAPE, dtype=torch.bfloat16)
    rows, ours_at = [], {}
    for entries in sizes:
        chunks = 5 if quick else 7
        ours_ops = 200 if quick else 400  # a steady state: each op's entry becomes idle again
        # the baseline scans entries/2 pinned entries per op: bound its time per chunk
        base_ops = max(2, min(ours_ops, (200_000 if quick else 1_000_000) // entries))
        with EmbeddingCache(
            entries * ENTRY_BYTES, alignment=ENTRY_BYTES, pin_memory=False, io_workers=1
        ) as cache:
            ours, base = ours_side(cache, entries, tensor), baseline_side(entries, tensor)
            ours_t, base_t = measure(ours, base, ours_ops, base_ops, chunks)
            ours_at[entries] = ours_t
            rows.append(
                _row(
                    f"evicting insert, {entries} entries, half pinned",
                    ours_t * 1e6,
                    base_t * 1e6,
                    "us/op",
                    base_t / ours_t,
                    "",
                    None,
                )
            )
            if entries == sizes[-1]:
                ours.unpin()
                base.unpin()
                free_t, base_free_t = measure(ours, base, ours_ops, base_ops, chunks)
                pinned_over_free = ours_t / free_t
                rows.append(
                    _row(
                        f"evicting insert, {entries} entries, {entries // 2} pinned / 0 pinned",
                        pinned_over_free,
                        base_t / base_free_t,
                        "x",
                        pinned_over_free,
                        f"<= {FLAT_PINNED}x",
                        pinned_over_free <= FLAT_PINNED,
                    )
                )
            cache.check_invariants()
    growth = ours_at[sizes[-1]] / ours_at[sizes[0]]
    rows.append(
        _row(
            f"evicting insert growth {sizes[-1]} vs {sizes[0]} entries",
            growth,
            None,
            "x",
            growth,
            f"<= {FLAT_GROWTH}x",
            growth <= FLAT_GROWTH,
        )
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
