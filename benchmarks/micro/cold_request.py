"""Where a one-item request's time goes right after a large copy (a diagnostic, not a target).

Benchmark 4 copies 4 MB items out of the pool one request each. Each 4 MB copy evicts the L2
cache, so the request that follows runs with its code and data cold, several times slower than
the same request in a warm loop. This script times each step of such a request (open, lookup,
``embeddings()``, the copy, close) and a few single calls, each right after a 4 MB copy, and
prints the median microseconds next to the same step timed warm (the same request without the
copy, run twice at once; the second is timed). The copy out of a fresh view is set beside a
copy out of a view made beforehand (the benchmark's raw baseline). Use it before and after a
change to the request path.
Run from the repository root: python -m benchmarks.micro.cold_request [--rounds N] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from embcache import EmbeddingCache, Item
from embcache.core.lifecycle import READY, Step, transition

MB = 1 << 20
SIZE = 4 * MB
COUNT = 32  # items cycled through, so every copy reads memory the last one did not
SHAPE = (SIZE // 2 // 1024, 1024)


def measure(rounds: int) -> dict[str, tuple[float, float]]:
    """Median seconds of each step, (cold, warm)."""
    torch.set_num_threads(1)
    items = [Item(f"cold-{i}", SHAPE, torch.bfloat16) for i in range(COUNT)]
    destination = torch.zeros(SHAPE, dtype=torch.bfloat16)
    times: dict[str, tuple[list[float], list[float]]] = {}
    with EmbeddingCache(SIZE * COUNT, pin_memory=False, io_workers=1) as cache:
        with cache.request("fill") as fill:
            fill.insert([it.key for it in items], [torch.ones(SHAPE, dtype=torch.bfloat16)] * COUNT)
        typed = cache.pool.view(torch.bfloat16)
        raws = [typed[i * SIZE // 2 : (i + 1) * SIZE // 2].view(SHAPE) for i in range(COUNT)]
        singles: dict[str, Callable[[], object]] = {
            "one as_strided view": lambda: typed.as_strided(SHAPE, (1024, 1), 0),
            "one transition()": lambda: transition(READY, Step.LOOKUP_HIT),
            "one time.monotonic()": time.monotonic,
        }

        def record(column: int, steps: dict[str, float]) -> None:  # column 0: cold, 1: warm
            for name, seconds in steps.items():
                times.setdefault(name, ([], []))[column].append(seconds)

        def request(i: int, copy: bool) -> dict[str, float]:
            clock = time.perf_counter
            t0 = clock()
            handle = cache.request("probe")
            t1 = clock()
            handle.lookup([items[i]], prefetch=False)
            t2 = clock()
            (view,) = handle.embeddings()
            t3 = clock()
            assert view is not None
            if copy:
                destination.copy_(view)
            t4 = clock()
            handle.close()
            t5 = clock()
            steps = {"open": t1 - t0, "lookup": t2 - t1, "embeddings": t3 - t2, "close": t5 - t4}
            if copy:
                steps["copy out of the fresh view"] = t4 - t3
            return steps

        def timed(call: Callable[[], object]) -> float:
            start = time.perf_counter()
            call()
            return time.perf_counter() - start

        for n in range(rounds):
            i = (n * 7) % COUNT
            destination.copy_(raws[(i + 3) % COUNT])  # evict: what follows runs cold
            record(0, request(i, copy=True))
            request(i, copy=False)  # warms the path up; the next one is timed warm
            record(1, request(i, copy=False))
            for name, call in singles.items():
                destination.copy_(raws[(i + 5) % COUNT])
                record(0, {name: timed(call)})
                record(1, {name: timed(call)})
            destination.copy_(raws[(i + 9) % COUNT])
            copy_raw = functools.partial(destination.copy_, raws[i])
            record(0, {"copy out of a view made beforehand": timed(copy_raw)})
    return {
        k: (statistics.median(c), statistics.median(w) if w else float("nan"))
        for k, (c, w) in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument(
        "--json", type=Path, metavar="OUT", help="write {step: [cold s, warm s]} as JSON"
    )
    args = parser.parse_args()
    if args.rounds <= 0:
        parser.error("--rounds must be > 0")
    steps = measure(args.rounds)
    print(f"{'step (one-item request, 4 MB item)':36} {'cold us':>9} {'warm us':>9}")
    for name, (cold, warm) in steps.items():
        print(f"{name:36} {cold * 1e6:9.1f} {warm * 1e6:9.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(steps, indent=1) + "\n")


if __name__ == "__main__":
    main()
