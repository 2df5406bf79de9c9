"""Loads through ``EmbeddingCache`` vs raw ``batch_get_into``, over TCP loopback to a real master.

A writer store lends a segment and puts N objects of one size (1 MB, 16 MB, 128 MB). Then two
readers load all N of them, alternately, several times each: the baseline is one raw
``MooncakeDistributedStore.batch_get_into`` of every key into a registered buffer; ours is a
request on an ``EmbeddingCache`` over a ``MooncakeStore`` (lookup: ``exists`` plus one load
batch on an I/O thread, wait, zero-copy ``embeddings()``), the cache cleared before each run so
that every item is loaded. Both readers are configured alike (no segment, same staging buffer)
and read the same objects from the same segment. Throughput is the median over runs.
Run: python -m benchmarks.micro.bench_mooncake [--quick]  (needs the mooncake extra)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from embcache import EmbeddingCache
from embcache.driver.item import Item
from embcache.store.mooncake import MooncakeStore
from embcache.store.mooncake_master import MooncakeMaster, find_master_binary

MB = 1 << 20
TARGET = 0.9
SIZES = (1 * MB, 16 * MB, 128 * MB)
PREFIX = "bench/"


def _items(size: int, total: int) -> list[Item]:
    count = max(1, total // size)
    return [Item(f"obj-{size}-{i}", (size // 2,), torch.bfloat16) for i in range(count)]


def _rate(nbytes: int, load: Callable[[], None]) -> float:
    """GB/s of one call of ``load``."""
    started = time.perf_counter()
    load()
    return nbytes / (time.perf_counter() - started) / 1e9


def run(quick: bool) -> list[dict[str, Any]]:
    """One row per item size: GB/s through the cache vs raw ``batch_get_into``."""
    total, reps = (64 * MB, 21) if quick else (512 * MB, 11)
    with tempfile.TemporaryDirectory() as log_dir:
        master = MooncakeMaster(find_master_binary(), Path(log_dir))
        master.start()
        try:
            return _measure(master, total, reps)
        finally:
            master.stop()


def _measure(master: MooncakeMaster, total: int, reps: int) -> list[dict[str, Any]]:
    span = max(total, max(SIZES))
    source = torch.randint(0, 256, (span,), dtype=torch.uint8)
    raw_pool = torch.zeros(span, dtype=torch.uint8)
    kwargs = {**master.store_kwargs(), "key_prefix": PREFIX}
    with (
        MooncakeStore(**kwargs, global_segment_size=span + 64 * MB) as writer,
        MooncakeStore(**kwargs, global_segment_size=0) as reader,
    ):
        writer.register_buffer(source)
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        status = raw.setup(
            "127.0.0.1", master.metadata_server, 0, 16 * MB, "tcp", "", master.master_address
        )
        assert status == 0 and raw.register_buffer(raw_pool.data_ptr(), span) == 0
        try:
            with EmbeddingCache(span, store=reader, pin_memory=False) as cache:
                return [_compare(size, total, reps, writer, cache, raw, raw_pool) for size in SIZES]
        finally:
            raw.close()


def _compare(
    size: int,
    total: int,
    reps: int,
    writer: MooncakeStore,
    cache: EmbeddingCache,
    raw: Any,
    raw_pool: torch.Tensor,
) -> dict[str, Any]:
    items = _items(size, total)
    keys = [item.key for item in items]
    offsets = [i * size for i in range(len(items))]
    assert writer.put_from(keys, offsets, [size] * len(items)) == [0] * len(items)
    names = [PREFIX + key for key in keys]
    ptrs = [raw_pool.data_ptr() + offset for offset in offsets]

    def baseline() -> None:
        assert raw.batch_get_into(names, ptrs, [size] * len(items)) == [size] * len(items)

    def ours() -> None:
        with cache.request("bench") as request:
            statuses = request.lookup(items)
            assert request.wait(60)
            views = request.embeddings()
            assert all(v is not None for v in views), (statuses, request.fallback_reasons())

    nbytes = size * len(items)
    baseline()  # warm both paths (connections, page faults) before timing
    cache.clear()
    ours()
    ours_rates, base_rates = [], []
    for _ in range(reps):  # alternate, so that drift hits both alike
        base_rates.append(_rate(nbytes, baseline))
        cache.clear()  # so that every item is loaded again
        ours_rates.append(_rate(nbytes, ours))
    cache.clear()
    writer.remove(keys, force=True)
    ours_rate, base_rate = statistics.median(ours_rates), statistics.median(base_rates)
    ratio = ours_rate / base_rate
    return {
        "name": f"mooncake load, {size // MB} MB items x {len(items)}",
        "ours": ours_rate,
        "baseline": base_rate,
        "unit": "GB/s",
        "ratio": ratio,
        "target": f">= {TARGET}x raw",
        "met": ratio >= TARGET,
    }


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'benchmark':40} {'ours':>8} {'baseline':>9} {'unit':>5} {'ratio':>6}  target")
    for r in rows:
        met = {True: "met", False: "MISSED", None: ""}[r["met"]]
        print(
            f"{r['name']:40} {r['ours']:8.3f} {r['baseline']:9.3f} {r['unit']:>5} "
            f"{r['ratio']:6.2f}  {r['target']} {met}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
