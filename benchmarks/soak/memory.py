"""Memory soak per front end: many distinct small items through a fixed pool, memory flat.

What runs. For each front end, ``--requests`` requests of ``--items / --requests`` new distinct
items each (small: 1-16 rows x 16 fp16/bf16, 32-512 bytes) plus two keys of the request before
(hits, while they last), single-threaded, through one pool of ``--pool-mib``. The items of the
warm-up's second half have one row each (32 bytes: one aligned unit), so the warm-up churns the
pool at its capacity in entries (``capacity / alignment``) and every dict kept per entry reaches
its largest table (embcache/DESIGN.md, "Memory bounds": a CPython dict's table is sized by its count
when it last ran out of room and never shrinks on deletion; the mixed sizes after the warm-up hold
fewer entries, and with a count near a third of a power of two a table flips between two sizes);
its first half has the mixed sizes, so the Mooncake segment the SGLang front end lends is full
by its end (its pages count in RSS as objects land in them).
- ``cache``: ``EmbeddingCache`` requests as the README's first example (no store: no global
  tier): ``lookup``, ``insert`` of the misses, ``embeddings()``;
- ``pipeline``: ``EncodePipeline.encode`` over the same cache, with a trivial encoder;
- ``sglang``: the SGLang adapter (``EmbeddingCacheController``) through MMEncoder's own call
  sequence (``tests/support/sglang_mmencoder.py``: ``batch_is_exist``, ``prefetch``, polls,
  pool views, ``store_to_pool_async`` + ``wait_store_to_pool`` + ``insert_batch``), on a real
  ``mooncake_master`` on loopback (SGLang always gives the adapter a Mooncake store; its
  master evicts by its own budget). Needs the ``mooncake`` extra and ``mooncake_master``.
The vLLM connector's soak is ``benchmarks/soak/vllm_memory.py`` (scheduler and worker roles).

What it reports, per front end. Resident memory (``VmRSS``, less tracemalloc's own) and
Python's traced heap (``tracemalloc``: from the interpreter's start, see
``traced_from_the_start``) after the warm-up (the first ``--warmup`` fraction of requests: the
pool full and evicting) and at the end, after a ``gc.collect()``; the growth in per cent (RSS)
and KiB (heap: the end, and the highest of every further tenth and the end, less the warm-up);
the heap at every further tenth of the run (a table still growing shows as a step up, a leak as
a slope); the containers the design bounds (entries, open requests, holds) at the end.
``--json`` prints one object with a row per front end. Exit status 1 when a row's RSS grows by
5% or more, or its heap at any further tenth or at the end is more than ``--heap-slack-kib``
above the warm-up's.

Run: ``python -m benchmarks.soak.memory`` (1,000,000 items, 100,000 requests, every front end
that can run here; minutes each), ``--quick`` (20,000 items, 2,000 requests, a 0.25 MiB pool).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from embcache import EmbeddingCache, EncodePipeline, Item, Status
from tests.support.helpers import rss

WIDTH = 16
ROWS = 16  # item i has 1 + i % ROWS rows
FRONT_ENDS = ("cache", "pipeline", "sglang")
# What the SGLang front end's worker lends the Mooncake store: small enough that the warm-up
# fills it (its pages are touched as objects land in it, which RSS counts: a 64 MiB segment
# filling after the warm-up showed as +39 MiB), large enough to hold several pools' worth.
SEGMENT_BYTES = 16 << 20


@dataclass(frozen=True)
class Row:
    """One front end's result."""

    front_end: str
    items: int
    requests: int
    seconds: float
    rss_warm_mib: float
    rss_end_mib: float
    rss_growth_pct: float
    heap_warm_kib: float
    heap_end_kib: float
    heap_growth_kib: float
    heap_rise_kib: float  # the highest of heap_by_tenth_kib less heap_warm_kib
    heap_by_tenth_kib: list[float]  # the traced heap at every further tenth of the run, the end
    containers: dict[str, int]

    def failed(self, heap_slack_kib: float) -> bool:
        """RSS grew by 5% or more, or the heap rose above the warm-up's by more than the slack
        at any further tenth or at the end."""
        return self.rss_growth_pct >= 5 or self.heap_rise_kib > heap_slack_kib


def rss_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``), less what ``tracemalloc`` keeps
    for its own traces (tens of MiB when tracing from the interpreter's start: not the
    process's to plan for, and it would dilute the growth in per cent)."""
    return rss() - tracemalloc.get_tracemalloc_memory()


class Rows:
    """The row count of item ``n``: 1 for the items of the warm-up's second half
    (``warm_items / 2 <= n < warm_items``: one aligned unit each, the most entries the pool can
    hold), else ``1 + n % ROWS``."""

    def __init__(self, warm_items: int) -> None:
        self.warm_items = warm_items

    def __call__(self, n: int) -> int:
        return 1 if self.warm_items // 2 <= n < self.warm_items else 1 + n % ROWS


def warm_requests(requests: int, warmup: float) -> int:
    """How many of ``requests`` are the warm-up's."""
    return max(1, int(requests * warmup))


def keys_of(request: int, per_request: int) -> list[int]:
    """Item numbers of ``request``: its new ones, then two of the request before."""
    new = list(range(request * per_request, (request + 1) * per_request))
    old = [] if request == 0 else [(request - 1) * per_request + j for j in (0, 1)]
    return new + old[: max(0, min(2, per_request))]


def soak(
    name: str,
    step: Callable[[int], None],
    containers: Callable[[], dict[str, int]],
    items: int,
    requests: int,
    warmup: float,
) -> Row:
    """Run ``step(i)`` for every request, measuring after the warm-up and at the end (tracing
    from here if nothing traces yet)."""
    started_here = not tracemalloc.is_tracing()
    if started_here:
        tracemalloc.start()
    warm_at = warm_requests(requests, warmup)
    tenths = {max(1, requests * k // 10) for k in range(1, 10)}
    rss_warm = heap_warm = 0
    trend: list[float] = []
    started = time.perf_counter()
    try:
        for i in tqdm(range(requests), desc=name, unit="req", mininterval=2, file=sys.stderr):
            step(i)
            if i + 1 == warm_at:
                gc.collect()
                rss_warm, heap_warm = rss_bytes(), tracemalloc.get_traced_memory()[0]
            if i + 1 in tenths and i + 1 > warm_at:
                gc.collect()
                trend.append(round(tracemalloc.get_traced_memory()[0] / 1024, 1))
        gc.collect()
        rss_end, heap_end = rss_bytes(), tracemalloc.get_traced_memory()[0]
    finally:
        if started_here:
            tracemalloc.stop()
    trend.append(round(heap_end / 1024, 1))
    return Row(
        name, items, requests, round(time.perf_counter() - started, 1),
        round(rss_warm / (1 << 20), 1), round(rss_end / (1 << 20), 1),
        round(100 * (rss_end - rss_warm) / rss_warm, 2),
        round(heap_warm / 1024, 1), round(heap_end / 1024, 1),
        round((heap_end - heap_warm) / 1024, 1), round(max(trend) - heap_warm / 1024, 1),
        trend, containers(),
    )  # fmt: skip


def _payloads(dtype: torch.dtype) -> list[torch.Tensor]:
    """One payload per row count (the keys are distinct; their bytes need not be)."""
    return [torch.full((1 + r, WIDTH), r, dtype=dtype) for r in range(ROWS)]


def _item(n: int, rows: Rows, dtype: torch.dtype) -> Item:
    return Item(f"img-{n}", (rows(n), WIDTH), dtype)


def _cache_containers(cache: EmbeddingCache) -> dict[str, int]:
    stats = cache.stats()
    return {"entries": stats.entries, "open_requests": stats.open_requests}


@contextlib.contextmanager
def cache_front_end(
    pool: int, per_request: int, rows: Rows
) -> Iterator[tuple[Callable[[int], None], Any]]:
    """``EmbeddingCache`` requests: lookup, insert the misses, read."""
    payloads = _payloads(torch.float16)
    with EmbeddingCache(pool, pin_memory=False) as cache:

        def step(i: int) -> None:
            numbers = keys_of(i, per_request)
            items = [_item(n, rows, torch.float16) for n in numbers]
            with cache.request(f"r{i}") as request:
                statuses = request.lookup(items)
                hit = [s.status is Status.HIT for s in statuses]
                missing = [n for n, h in zip(numbers, hit, strict=True) if not h]
                request.insert(
                    [f"img-{n}" for n in missing], [payloads[rows(n) - 1] for n in missing]
                )
                request.embeddings()

        yield step, lambda: _cache_containers(cache)


class _Encoder:
    """Encodes an input (a row count) to a payload of that many rows."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self._payloads = _payloads(torch.float16)

    def __call__(self, inputs: Sequence[Any], /) -> list[torch.Tensor]:
        return [self._payloads[r - 1] for r in inputs]


@contextlib.contextmanager
def pipeline_front_end(
    pool: int, per_request: int, rows: Rows
) -> Iterator[tuple[Callable[[int], None], Any]]:
    """``EncodePipeline.encode`` over a store-less cache."""
    with EmbeddingCache(pool, pin_memory=False) as cache:
        pipeline = EncodePipeline(cache, _Encoder())

        def step(i: int) -> None:
            numbers = keys_of(i, per_request)
            items = [_item(n, rows, torch.float16) for n in numbers]
            pipeline.encode(f"r{i}", items, [rows(n) for n in numbers])

        yield step, lambda: _cache_containers(cache)


@contextlib.contextmanager
def sglang_front_end(
    pool: int, per_request: int, rows: Rows
) -> Iterator[tuple[Callable[[int], None], Any]]:
    """The SGLang adapter through MMEncoder's call sequence, on a real mooncake_master."""
    from embcache.integrations.sglang import EmbeddingCacheController
    from embcache.store.mooncake import MooncakeStore, quiet_native_logging
    from embcache.store.mooncake_master import MooncakeMaster
    from tests.support import sglang_mmencoder

    quiet_native_logging()
    encoder = sglang_mmencoder.Encoder()
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster())
        for name, value in MooncakeMaster.CLIENT_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        store = stack.enter_context(
            MooncakeStore(**master.store_kwargs(), global_segment_size=SEGMENT_BYTES)
        )
        store.connect()
        controller = EmbeddingCacheController(
            store,
            max_pool_size_gb=pool / (1 << 30),
            hidden_dims={sglang_mmencoder.Modality.IMAGE: sglang_mmencoder.DIM},
            dtype=sglang_mmencoder.DTYPE,
        )
        stack.callback(controller.close)

        def step(i: int) -> None:
            numbers = keys_of(i, per_request)
            served = sglang_mmencoder.serve(
                controller, 0, 1, f"r{i}", [f"img-{n}" for n in numbers],
                [rows(n) for n in numbers], encoder,
            )  # fmt: skip
            served.finish()
            encoder.calls.clear()  # the replay's own record of calls, not the adapter's

        def containers() -> dict[str, int]:
            stats = controller.get_stats()
            return {
                "entries": stats["num_cached"],
                "open_requests": stats["embcache"]["open_requests"],
                **{f"holds_{k}": v for k, v in stats["holds"].items()},
            }

        yield step, containers


MAKERS = {"cache": cache_front_end, "pipeline": pipeline_front_end, "sglang": sglang_front_end}


def can_run(front_end: str) -> str | None:
    """Why ``front_end`` cannot run here, or None."""
    if front_end != "sglang":
        return None
    import importlib.util

    from embcache.store.mooncake_master import find_master_binary

    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake extra is not installed"
    if find_master_binary() is None:
        return "mooncake_master is not on PATH"
    return None


def traced_from_the_start(module: str, argv: Sequence[str] | None) -> None:
    """Run ``module`` again under ``python -X tracemalloc`` unless this process traces already.

    ``tracemalloc`` counts only blocks allocated while it traces. A table the interpreter
    allocated before (its interned-string table: 3.75 MiB here, which the SGLang front end's
    ``asyncio.run`` per request churns by a few strings each) and reallocates during the run
    would count in full, as growth, though its old block was as large (the SGLang soak's step
    of +3.75 MiB, about 37,000 requests in). Traced from the interpreter's start, a
    reallocation counts only what it changes."""
    if tracemalloc.is_tracing():
        return
    args = list(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-X", "tracemalloc", "-m", module, *args])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--front-end", nargs="+", choices=FRONT_ENDS, default=list(FRONT_ENDS))
    parser.add_argument("--items", type=int, default=1_000_000, help="distinct items in all")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument(
        "--pool-mib", type=float, default=None, help="the pool of each front end (default: 4, "
        "--quick 0.25: the warm-up fills it several times over)"
    )
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of requests")
    parser.add_argument("--heap-slack-kib", type=float, default=256.0)
    parser.add_argument("--quick", action="store_true", help="20,000 items, 2,000 requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    traced_from_the_start("benchmarks.soak.memory", argv)
    if args.quick:
        args.items, args.requests = 20_000, 2_000
    if args.pool_mib is None:
        args.pool_mib = 0.25 if args.quick else 4.0
    if args.requests <= 0 or args.items < args.requests:
        parser.error("need --requests > 0 and --items >= --requests")
    if not 0 < args.warmup < 1:
        parser.error("--warmup must be in (0, 1)")
    pool = int(args.pool_mib * (1 << 20)) // 256 * 256
    per_request = args.items // args.requests
    torch.set_num_threads(1)
    rows, skipped = [], {}
    for front_end in args.front_end:
        why = can_run(front_end)
        if why is not None:
            skipped[front_end] = why
            print(f"soak_memory: {front_end} skipped: {why}", file=sys.stderr)
            continue
        warm_items = warm_requests(args.requests, args.warmup) * per_request
        with MAKERS[front_end](pool, per_request, Rows(warm_items)) as (step, containers):
            rows.append(soak(front_end, step, containers, args.items, args.requests, args.warmup))
    failed = [r.front_end for r in rows if r.failed(args.heap_slack_kib)]
    if args.json:
        print(json.dumps({"pool_bytes": pool, "rows": [asdict(r) for r in rows],
                          "skipped": skipped, "failed": failed}))  # fmt: skip
    else:
        print("| front end | items | requests | s | RSS after warm-up | RSS end | growth | "
              "heap after warm-up | heap growth | heap's highest rise | "
              "containers at the end |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r.front_end} | {r.items:,} | {r.requests:,} | {r.seconds} | "
                  f"{r.rss_warm_mib} MiB | {r.rss_end_mib} MiB | {r.rss_growth_pct:+.2f}% | "
                  f"{r.heap_warm_kib} KiB | {r.heap_growth_kib:+.1f} KiB | "
                  f"{r.heap_rise_kib:+.1f} KiB | "
                  f"{r.containers} |")  # fmt: skip
        for r in rows:
            print(f"{r.front_end}: heap after the warm-up {r.heap_warm_kib} KiB; at each further "
                  f"tenth and the end: {r.heap_by_tenth_kib} KiB")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
