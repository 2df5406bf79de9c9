"""Metadata memory: Python bytes per cached entry, measured with tracemalloc.

A cache of N idle READY entries is built with tracing on: the keys (64-character hex digests,
as image hashes are) are made inside the traced region and the caller's references dropped, so
what remains is what the cache keeps per entry (Entry, Item, shape tuple, key, the allocator's
blocks, the entry, offset and LRU indexes). The pool itself is torch memory, which tracemalloc
does not see, and is not metadata. The baseline is the least a cache must keep: one
OrderedDict (recency order) of key -> (offset, size, shape, dtype), built the same way.
Target: at most 512 bytes per entry at 100k entries. ``benchmarks.peers.bench_peers.metadata_rows``
measures the peers (SGLang's paged controller, the original PR's) the same way.
Run from the repository root: python -m benchmarks.micro.bench_metadata [--quick]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from typing import Any

import torch

from benchmarks.common import hex_keys, insert_all, print_rows, traced_bytes
from embcache import EmbeddingCache

ENTRY_BYTES = 256
SHAPE = (1, ENTRY_BYTES // 2)  # bf16
TARGET = 512


def ours_bytes(entries: int) -> int:
    source = torch.zeros(SHAPE, dtype=torch.bfloat16)

    def build() -> EmbeddingCache:
        cache = EmbeddingCache(
            entries * ENTRY_BYTES, alignment=ENTRY_BYTES, pin_memory=False, io_workers=1
        )
        with cache.request("fill") as fill:
            insert_all(fill, hex_keys(entries), source)
        return cache

    used, cache = traced_bytes(build)
    with cache:
        stats = cache.stats()
        assert stats.entries == entries and stats.pinned_entries == 0
    return used


def baseline_bytes(entries: int) -> int:
    source = torch.zeros(SHAPE, dtype=torch.bfloat16)

    def build() -> OrderedDict[str, tuple[int, int, tuple[int, ...], torch.dtype]]:
        table: OrderedDict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = OrderedDict()
        for i, key in enumerate(hex_keys(entries)):
            table[key] = (i * ENTRY_BYTES, ENTRY_BYTES, tuple(source.shape), source.dtype)
        return table

    used, table = traced_bytes(build)
    assert len(table) == entries
    return used


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row: bytes per entry, ours vs the bare OrderedDict (ratio ours / baseline)."""
    entries = 20_000 if quick else 100_000
    ours = ours_bytes(entries) / entries
    base = baseline_bytes(entries) / entries
    return [
        {
            "name": f"metadata per entry, {entries} entries",
            "ours": ours,
            "baseline": base,
            "unit": "B/entry",
            "ratio": ours / base,
            "target": f"<= {TARGET} B",
            "met": ours <= TARGET,
        }
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
