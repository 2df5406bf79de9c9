"""Memory soak of the vLLM connector: both roles in vLLM's call order, memory flat.

What runs. ``EmbcacheECConnector``'s scheduler role and two worker roles (ranks), in this
process, through vLLM 0.33.0's engine-step order (``tests.support.vllm_engine.Engine``:
``ensure_cache_available``, ``has_cache_item``, ``update_state_after_alloc`` encodes first,
``build_connector_meta``, every rank's ``start_load_caches`` / ``save_caches`` /
``build_connector_worker_meta``, ``request_finished`` before ``update_connector_output``), one
request a step: ``--requests`` requests of ``--items / --requests`` new distinct items each
(1-16 rows x 16 fp16: 32-512 bytes; one row in the warm-up's second half, which so churns
the pool at its capacity in entries, as ``benchmarks/soak/memory.py`` explains) plus two items
of the request before (declared present and loaded by every rank while they last), over a pool
of ``--pool-mib`` and no global tier (the README's configuration, scaled down). Every rank
checks the bytes of what it reads.

What it prints: one row: front end, items, requests, resident memory (``VmRSS``) after the
warm-up (``--warmup`` of the requests: the pool full and evicting) and at the end, its growth
in per cent, and the growth of Python's traced heap (``tracemalloc``, from the interpreter's
start: ``benchmarks.soak.memory.traced_from_the_start``) in
KiB, at the end and at its highest (every further tenth and the end); the heap at each tenth;
then the containers the design bounds, at the end (embcache/DESIGN.md, "Memory bounds", "vLLM
connector"). Exit status 1 when RSS grows by 5% or more, or the heap rises more than
``--heap-slack-kib`` above the warm-up's at any further tenth or the end, or the engine saw an
error.

Run: ``python -m benchmarks.soak.vllm_memory [--json OUT]`` (1,000,000 items, 100,000 requests;
minutes) or ``--items 20000 --requests 2000``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.soak.memory import Row, Rows, soak, traced_from_the_start, warm_requests
from tests.support import vllm_wheel
from tests.support.vllm_wheel import FakeRequest

WIDTH = 16


def keys_of(request: int, per_request: int) -> list[int]:
    """Item numbers of ``request``: its new ones, then two of the request before."""
    new = list(range(request * per_request, (request + 1) * per_request))
    old = [] if request == 0 else [(request - 1) * per_request + j for j in (0, 1)]
    return new + old[: min(2, per_request)]


def containers(scheduler: Any, engine: Any) -> dict[str, int]:
    """The sizes of every container the connector keeps, and the engine's own."""
    side = scheduler._scheduler  # the soak reads the bounded containers by name
    cache = side.cache.stats()
    return {
        "entries": cache.entries,
        "cache_requests": cache.open_requests,
        "held": len(side._held),
        "finishing": len(side._finishing),
        "quarantined": len(side._quarantined),
        "load_acks": len(side._load_acks),
        "save_acks": len(side._save_acks),
        "step_transfers": len(side._step_loads) + len(side._step_saves),
        "engine_refs": len(engine.refs),
        "errors": len(engine.report.errors),
    }


@contextlib.contextmanager
def vllm_front_end(
    pool: int, per_request: int, rows_of: Rows
) -> Iterator[tuple[Callable[[int], None], Callable[[], dict[str, int]]]]:
    """The step of request ``i`` and the containers, over a fresh connector pair."""
    from tests.support.vllm_engine import Engine

    vllm_wheel.install()
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    extra = {"pool_bytes": pool, "embed_width": WIDTH}
    make = ECConnectorFactory.create_connector
    scheduler = make(vllm_wheel.vllm_config("ec_both", extra, 2), ECConnectorRole.SCHEDULER)
    role = ECConnectorRole.WORKER
    workers = [make(vllm_wheel.vllm_config("ec_both", extra, 2, r), role) for r in (0, 1)]
    engine = Engine(scheduler, workers, WIDTH, admit=1)
    try:

        def step(i: int) -> None:
            numbers = keys_of(i, per_request)
            keys = [f"img-{n}" for n in numbers]
            rows = {k: rows_of(n) for k, n in zip(keys, numbers, strict=True)}
            engine.add(FakeRequest(f"req-{i}", keys, rows, 1))
            engine.step()

        yield step, lambda: containers(scheduler, engine)
    finally:
        scheduler.shutdown()
        for worker in workers:
            worker.shutdown()


def run(items: int, requests: int, pool: int, warmup: float = 0.1) -> Row:
    """The soak (module docstring); its row."""
    per_request = items // requests
    torch.set_num_threads(1)
    rows = Rows(warm_requests(requests, warmup) * per_request)
    with vllm_front_end(pool, per_request, rows) as (step, sizes):
        return soak("vllm", step, sizes, items, requests, warmup)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--items", type=int, default=1_000_000, help="distinct items in all")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--pool-mib", type=float, default=4.0, help="the connector's pool")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of requests")
    parser.add_argument("--heap-slack-kib", type=float, default=256.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the row here")
    parser.add_argument(
        "--trace-soak-only",
        action="store_true",
        help="trace the heap from the soak's start, not the interpreter's (no second run under "
        "-X tracemalloc: quicker, but a table the interpreter reallocates counts as growth)",
    )
    args = parser.parse_args(argv)
    if not args.trace_soak_only:
        traced_from_the_start("benchmarks.soak.vllm_memory", argv)
    if args.requests <= 0 or args.items < args.requests:
        parser.error("need --requests > 0 and --items >= --requests")
    if not 0 < args.warmup < 1:
        parser.error("--warmup must be in (0, 1)")
    pool = int(args.pool_mib * (1 << 20)) // 256 * 256
    row = run(args.items, args.requests, pool, args.warmup)
    print("| front end | items | requests | RSS after warm-up | RSS end | growth | "
          "tracemalloc growth | tracemalloc's highest rise |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {row.front_end} | {row.items:,} | {row.requests:,} | {row.rss_warm_mib} MiB | "
          f"{row.rss_end_mib} MiB | {row.rss_growth_pct:+.2f}% | "
          f"{row.heap_growth_kib:+.1f} KiB | {row.heap_rise_kib:+.1f} KiB |")  # fmt: skip
    print(
        f"heap after the warm-up: {row.heap_warm_kib} KiB; at each further tenth and the end: "
        f"{row.heap_by_tenth_kib} KiB"
    )
    print(f"containers at the end: {row.containers}")
    if args.json is not None:
        args.json.write_text(json.dumps({"pool_bytes": pool, **asdict(row)}, indent=1) + "\n")
    return 1 if row.failed(args.heap_slack_kib) or row.containers["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
