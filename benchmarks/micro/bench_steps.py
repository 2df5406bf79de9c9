"""Steps and Python work per request, by sequence: bytecodes, Python calls and C calls (as
``bench_instructions --bytecodes`` counts them: exact, no valgrind) and funnel calls
(``StepRunner.run``: one lock, one core step and its effects each; the request's own, not
the ends of store transfers on the I/O threads).

Sequences (8 items of 256 B, bf16, CPU, no store unless named):
- ``cache.request`` + ``lookup(prefetch=False)`` + ``embeddings`` + close over 1000 idle
  entries (the hit row of ``bench_instructions``); the serving sequence (``lookup``, ``wait``,
  ``embeddings``); an all-hit request that also reads its mask;
- a request whose 8 items miss: ``lookup(reserve_misses=True)``, ``fallback_mask``,
  ``embeddings``, ``insert`` of the 8, close; a request inserting one item;
- ``cache.lookup`` (open and look up in one step) for the all-hit and the miss requests;
- ``EncodePipeline.encode`` of 8 misses, then of the same 8 (hits);
- the SGLang adapter under MMEncoder's calls (``bench_sglang_adapter.Driver``, a store that
  drops every put): a miss request, then a hit request.
Run from the repository root: python -m benchmarks.micro.bench_steps [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.bench_instructions import python_work
from benchmarks.peers.bench_sglang_adapter import SMALL, Driver, LRUController, NullGlobalStore
from embcache import EmbeddingCache, EncodePipeline, Item

SHAPE = (8, 16)
DTYPE = torch.bfloat16
WARMUP, OPS = 20, 50
Op = Callable[[int], None]


def counted(cache: EmbeddingCache, op: Op, n: int) -> int:
    """Funnel calls of ``cache`` during ``op(n)``, the request's own: the ends of store
    transfers (``end_loads``, ``end_publishes``, on the I/O threads) are not counted."""
    calls = [0]
    runner = cache.runner
    run = runner.run  # the funnel itself is what is counted

    def counting(step: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if step.__name__ not in ("end_loads", "end_publishes"):
            calls[0] += 1
        return run(step, *args, **kwargs)

    runner.run = counting  # type: ignore[method-assign]
    try:
        op(n)
    finally:
        del runner.run  # the class's own again
    return calls[0]


def measure(
    cache: EmbeddingCache, op: Op, warmup: int = WARMUP, ops: int = OPS
) -> dict[str, float]:
    for n in range(warmup):
        op(n)
    work = python_work(op, warmup, ops)
    work["funnel calls"] = counted(cache, op, warmup + ops)
    return work


def filled(entries: int) -> EmbeddingCache:
    cache = EmbeddingCache(entries * 256, auto_fence=None, pin_memory=False)
    tensor = torch.zeros(SHAPE, dtype=DTYPE)
    with cache.request("fill") as fill:
        for start in range(0, entries, 256):
            keys = [f"img{i}" for i in range(start, min(entries, start + 256))]
            fill.insert(keys, [tensor] * len(keys), publish=False)
    return cache


def sequences() -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    hits = filled(1000)
    batches = [[Item(f"img{(n * 8 + i) % 1000}", SHAPE, DTYPE) for i in range(8)]
               for n in range(WARMUP + OPS + 1)]  # fmt: skip

    def hit(n: int) -> None:
        with hits.request(f"h{n}") as request:
            request.lookup(batches[n], prefetch=False)
            request.embeddings()

    def serving(n: int) -> None:
        with hits.request(f"s{n}") as request:
            request.lookup(batches[n])
            request.wait()
            request.embeddings()

    def hit_mask(n: int) -> None:
        with hits.request(f"m{n}") as request:
            request.lookup(batches[n], reserve_misses=True)
            request.fallback_mask()
            request.embeddings()

    def fused_hit(n: int) -> None:
        request, _ = hits.lookup(f"f{n}", batches[n], reserve_misses=True)
        with request:
            request.fallback_list()
            request.embeddings()

    out["hit: request, lookup(prefetch=False), embeddings, close"] = measure(hits, hit)
    out["serving: request, lookup, wait, embeddings, close"] = measure(hits, serving)
    out["all-hit with mask: request, lookup, fallback_mask, embeddings"] = measure(hits, hit_mask)
    fused = hasattr(EmbeddingCache, "lookup")  # (a version before it: those rows are left out)
    if fused:
        out["all-hit, cache.lookup: fallback_list, embeddings"] = measure(hits, fused_hit)
    hits.close()

    misses = EmbeddingCache(1000 * 256, auto_fence=None, pin_memory=False)
    tensor = torch.zeros(SHAPE, dtype=DTYPE)

    def items(prefix: str, n: int) -> list[Item]:
        return [Item(f"{prefix}{n}-{i}", SHAPE, DTYPE) for i in range(8)]

    def miss(n: int) -> None:
        fresh = items("x", n)
        with misses.request(f"x{n}") as request:
            request.lookup(fresh, reserve_misses=True)
            request.fallback_mask()
            request.embeddings()
            request.insert([it.key for it in fresh], [tensor] * 8, publish=False)

    def fused_miss(n: int) -> None:
        fresh = items("y", n)
        request, _ = misses.lookup(f"y{n}", fresh, reserve_misses=True)
        with request:
            request.fallback_list()
            request.embeddings()
            request.insert([it.key for it in fresh], [tensor] * 8, publish=False)

    def insert_one(n: int) -> None:
        with misses.request(f"e{n}") as request:
            request.insert([f"fresh{n}"], [tensor], publish=False)

    out["8 misses: request, lookup(reserve), fallback_mask, embeddings, insert"] = measure(
        misses, miss
    )
    if fused:
        out["8 misses, cache.lookup: fallback_list, embeddings, insert"] = measure(
            misses, fused_miss
        )
    out["insert of 1 item in a request"] = measure(misses, insert_one)
    misses.close()

    class Encoder:
        device = torch.device("cpu")

        def __call__(self, inputs: list[Any]) -> list[torch.Tensor]:
            return [torch.zeros(SHAPE, dtype=DTYPE) for _ in inputs]

    piped = EmbeddingCache(1000 * 256, auto_fence=None, pin_memory=False)
    pipeline = EncodePipeline(piped, Encoder())
    out["pipeline: 8 misses"] = measure(
        piped, lambda n: pipeline.encode(f"pm{n}", items("p", n), [None] * 8)
    )
    out["pipeline: 8 hits"] = measure(
        piped, lambda n: pipeline.encode(f"ph{n}", items("p", n), [None] * 8)
    )
    piped.close()

    controller = LRUController(  # (the default policy may refuse a fresh output: a hit would miss)
        NullGlobalStore(), max_pool_size_gb=SMALL.pool_items * 256 / (1 << 30),
        hidden_dims={"IMAGE": SMALL.dim}, dtype=DTYPE,
    )  # fmt: skip
    cache = controller.cache
    driver = Driver(controller, "IMAGE", SMALL)
    outputs = [torch.zeros(8, 16, dtype=DTYPE) for _ in range(8)]

    def published() -> None:
        while cache.stats().publishes_ok < cache.stats().publishes_started:
            time.sleep(0.001)

    def keys(n: int) -> list[str]:
        return [f"k{n}-{i}" for i in range(8)]

    try:
        out["SGLang adapter: miss request"] = measure(
            cache, lambda n: driver.miss(keys(n), outputs)
        )
        published()
        for n in range(36):  # the hit requests' keys, inserted (the pool holds 64 requests)
            driver.miss(keys(1000 + n), outputs)
        published()
        out["SGLang adapter: hit request"] = measure(
            cache, lambda n: driver.hit(f"r{n}", keys(1000 + n)), 5, 30
        )
        published()
    finally:
        driver.close()
        controller.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the counts as JSON")
    args = parser.parse_args()
    counts = sequences()
    units = ("bytecodes", "python calls", "C calls", "funnel calls")
    print(f"{'sequence':72s}" + "".join(f"{u:>14s}" for u in units))
    for name, work in counts.items():
        print(f"{name:72s}" + "".join(f"{work[u]:14.0f}" for u in units))
    if args.json is not None:
        args.json.write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
