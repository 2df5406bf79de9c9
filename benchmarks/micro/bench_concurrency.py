"""Concurrency: requests/s of the demo workload with 1, 2, 4 and 8 client threads.

Each run is ``embcache.tools.demo.run_demo`` with its default workload (a catalogue of synthetic
images of mixed sizes, requests of 1-4 images with Zipf popularity, through ``EncodePipeline``
with ``TinyViT`` as the encoder, no global tier (the demo's default store ``none``), a pool
small enough that eviction matters), only ``concurrency`` (the client threads) changing. Every
run starts from a fresh cache and must end leak-free with no errors. The baseline of each row
is the one-thread run of the same suite: the ratio is the scaling (the machine's cores and the
GIL bound it; the encoder runs torch with one intra-op thread per client thread).
Run from the repository root: python -m benchmarks.micro.bench_concurrency [--quick]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.common import print_rows
from embcache.tools.demo import DemoConfig, run_demo

THREADS = (1, 2, 4, 8)


def requests_per_s(threads: int, requests: int) -> float:
    result = run_demo(DemoConfig(requests=requests, concurrency=threads))
    if result.errors or result.leak_report:
        raise RuntimeError(
            f"demo with {threads} threads: {len(result.errors)} errors {result.errors[:2]}, "
            f"leaks {result.leak_report}"
        )
    return result.requests_per_s


def run(quick: bool = False) -> list[dict[str, Any]]:
    """One row per thread count: requests/s, against the one-thread run (ratio = scaling)."""
    requests = 200 if quick else 800
    rates = {}
    for threads in THREADS:
        rates[threads] = requests_per_s(threads, requests)
        print(f"  {threads} threads: {rates[threads]:.1f} requests/s", file=sys.stderr)
    single = rates[1]
    return [
        {
            "name": f"demo requests/s, {threads} threads",
            "ours": rate,
            "baseline": single,
            "unit": "req/s",
            "ratio": rate / single,
            "target": "",
            "met": None,
        }
        for threads, rate in rates.items()
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
