"""The eviction index against the scan it replaces, on a small pool of mixed sizes (issue 56,
point 2): a 4 MiB pool of items of 0.9-57 KB (uniform in bytes), every request inserting one
fresh item into the full pool and closing, so that most allocations evict, many of them by a
search for several adjacent victims.

Both sides run the same cache, the same items in the same order: one whose core searches with
its ``EvictionIndex`` from the first candidate (``INDEX_FROM`` 0), one whose core never does
(it feeds ``VictimSearch`` its order from the head, as before the index). Reported: candidates
examined per evicting allocation that searched (the index's ``examined``; the scan's count of
candidates fed), and seconds per request, timed in alternating chunks (medians), with their
ratio. The choices are the same (tests/test_eviction_index.py): the victims evicted, bytes and
counts, are printed for both and must match.

With ``--callgrind`` it counts instead the instructions per request of each side under
``valgrind --tool=callgrind`` (as ``benchmarks.peers.bench_instructions``: main thread only,
collection toggled around two regions of ``low`` and ``high`` requests after the same warm-up,
the difference over ``high - low``), the index forced on from the first candidate
(``INDEX_FROM`` 0) and off. ``POOL_MIB`` (environment) sets the pool (default 4).
Run from the repository root:
python -m benchmarks.micro.bench_eviction_index [--quick] [--callgrind]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from embcache import EmbeddingCache, Item
from embcache.core import entry_actions, state
from tests.support.callgrind import per_operation, total

POOL = int(os.environ.get("POOL_MIB", "4")) << 20
ROOT = Path(__file__).resolve().parents[2]
SMALLEST, LARGEST = 900, 57 << 10


class Scanned:
    """Counts the candidates the scan is fed (``entry_actions._scan``, wrapped)."""

    def __init__(self) -> None:
        self.searches = 0
        self.examined = 0
        self._scan = entry_actions._scan

    def __call__(self, st: Any, size: int) -> Any:
        self.searches += 1
        order = st.order
        before = len(order)
        found = self._scan(st, size)
        window = found[0]
        if window is None:
            self.examined += before
        else:  # the scan stopped at the newest victim's rank
            victims = {victim.key for victim in found[1]}
            for rank, key in enumerate(order):
                if key in victims:
                    victims.discard(key)
                    if not victims:
                        self.examined += 1 + rank
                        break
        return found


def make_cache(indexed: bool) -> EmbeddingCache:
    """A cache whose core searches with the index from its first candidate, or never."""
    before = state.INDEX_FROM
    state.INDEX_FROM = 0 if indexed else 1 << 40
    try:
        return EmbeddingCache(POOL, pin_memory=False, policy="lru", auto_fence=None)
    finally:
        state.INDEX_FROM = before


def request(cache: EmbeddingCache, n: int, nbytes: int, payload: torch.Tensor) -> None:
    key = f"item-{n:09d}"
    with cache.request(f"r{n}") as req:
        req.lookup([Item(key, (nbytes,), torch.uint8)])
        req.insert([key], [payload[:nbytes]])


def child(low: int, high: int) -> None:
    """Under callgrind: each side warmed up, then ``low`` requests (dump), ``high`` (dump)."""
    rng = random.Random(56)
    warm = 2_000 + 3 * POOL // ((SMALLEST + LARGEST) // 2)  # full, and churned
    sizes = [rng.randint(SMALLEST, LARGEST) for _ in range(warm + low + high)]
    payload = torch.zeros(LARGEST, dtype=torch.uint8)
    order = []
    for name in ("index", "scan"):
        cache = make_cache(name == "index")
        for n in range(warm):
            request(cache, n, sizes[n], payload)
        start = warm
        for count in (low, high):
            gc.collect()
            torch._C._valgrind_toggle()
            for n in range(start, start + count):
                request(cache, n, sizes[n], payload)
            torch._C._valgrind_toggle_and_dump_stats()
            start += count
            order.append(name)
        cache.close()
    print(json.dumps({"order": order}))


def instructions(low: int, high: int) -> dict[str, float]:
    """Instructions per request of each side (callgrind, main thread)."""
    valgrind = shutil.which("valgrind")
    assert valgrind is not None, "valgrind not on PATH"
    with tempfile.TemporaryDirectory(prefix="embcache-callgrind-") as folder:
        out = Path(folder)
        command = [
            valgrind, "--tool=callgrind", "--collect-atstart=no", "--separate-threads=yes",
            f"--callgrind-out-file={out}/cg.%p", sys.executable, "-m",
            "benchmarks.micro.bench_eviction_index", "--child", f"--low={low}", f"--high={high}",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        order = json.loads(done.stdout.strip().splitlines()[-1])["order"]
        main_thread = sorted(
            out.glob("cg.*.*-01"), key=lambda p: int(p.name.split(".")[-1].split("-")[0])
        )
        counts = [total(path) for path in main_thread]
    return per_operation(order, counts, high - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--low", type=int, default=50)
    parser.add_argument("--high", type=int, default=550)
    args = parser.parse_args()
    if args.child:
        child(args.low, args.high)
        return
    if args.callgrind:
        per = instructions(args.low, args.high)
        print(f"pool {POOL >> 20} MiB, items {SMALLEST}-{LARGEST} B: instructions per request")
        print(
            f"index {per['index'] / 1e3:.1f}k, scan {per['scan'] / 1e3:.1f}k,"
            f" ratio scan/index {per['scan'] / per['index']:.3f}"
        )
        return
    rng = random.Random(56)
    count = 3_000 if args.quick else 20_000
    sizes = [rng.randint(SMALLEST, LARGEST) for _ in range(count)]
    payload = torch.zeros(LARGEST, dtype=torch.uint8)
    caches = {"index": make_cache(True), "scan": make_cache(False)}
    counted = make_cache(False)  # the scan again, untimed, counting what it examines
    warm = count // 5
    for cache in (*caches.values(), counted):
        for n in range(warm):
            request(cache, n, sizes[n], payload)
    scanned = Scanned()
    entry_actions._scan = scanned
    try:
        for n in range(warm, count):
            request(counted, n, sizes[n], payload)
    finally:
        entry_actions._scan = scanned._scan
    counted.close()
    index = caches["index"].runner.core._state.index
    assert index is not None
    index.searches = index.examined = index.walked = 0
    times: dict[str, list[float]] = {name: [] for name in caches}
    chunk = 200
    for first in range(warm, count, chunk):
        for name, cache in caches.items():
            start = time.perf_counter()
            for n in range(first, min(first + chunk, count)):
                request(cache, n, sizes[n], payload)
            times[name].append((time.perf_counter() - start) / chunk)
    rows = {}
    for name, cache in caches.items():
        stats = cache.stats()
        rows[name] = (stats.evictions, stats.evicted_bytes, stats.entries)
        cache.close()
    print(f"pool {POOL >> 20} MiB, items {SMALLEST}-{LARGEST} B, {count - warm} timed requests")
    if not scanned.searches:  # (compiled: the core calls its own _scan, not the wrapper)
        print("the scan's candidates are counted on the pure build (EMBCACHE_PURE=1) only")
    print(f"searches: index {index.searches}, scan {scanned.searches}")
    print(
        f"candidates examined per search: index {index.examined / max(index.searches, 1):.1f}"
        f" (blocks walked {index.walked / max(index.searches, 1):.1f}),"
        f" scan {scanned.examined / max(scanned.searches, 1):.1f}"
    )
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(
        f"us per request (median of chunks): index {us['index']:.2f}, scan {us['scan']:.2f},"
        f" ratio scan/index {us['scan'] / us['index']:.3f}"
    )
    print(f"(evictions, evicted bytes, entries): index {rows['index']}, scan {rows['scan']}")
    assert rows["index"] == rows["scan"], "the index chose differently from the scan"


if __name__ == "__main__":
    main()
