"""Two encode-server processes, with and without one shared ``mooncake_master``.

Each process builds the same workload (same seed) and serves every other request of the
steady mix (process 0 the even ones, process 1 the odd ones), with ``clients`` threads, through
``EncodePipeline`` on its own ``EmbeddingCache`` (the best policy, the main run's pool size).
Shared: both caches use a ``MooncakeStore`` on one real local ``mooncake_master`` (each lends
half the hot images' bytes to the store), so an image one process encoded is a global hit
(a store load instead of an encode) for the other. Alone: each has a null global store. The two
processes run at the same time; the row sums their requests/s and counts encoder passes,
global hits (loads that served an item) and publishes.

The original PR's controller is not run here: its re-implementation
(``tests.support.baselines.OriginalPRController``) has no global store, and SGLang's own Mooncake
store is not loaded from the wheel (it needs more of SGLang than the controller's module).

    python -m benchmarks.server.fleet [--size tiny]    # both rows, printed as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.peers.bench_sglang_adapter import NullGlobalStore
from benchmarks.server.contenders import Lane, PipelineServer
from benchmarks.server.workload import SIZES, Config, MeteredEncoder
from embcache import GlobalStore
from embcache.tools.encoders import TinyViT
from tests.support.server_workload import Workload, make_encoder, make_workload

PROCESSES = 2
MIN_SEGMENT = 16 << 20  # Mooncake's least global segment
SUMMED = (
    "requests",
    "encoded_images",
    "global_hits",
    "loads_failed",
    "publishes_ok",
    "publishes_failed",
)
SKIPPED = {
    "original PR": "its re-implementation has no global store",
    "SGLang 0.5.23": "its Mooncake store needs more of SGLang than the controller module",
}


def serve_share(
    config: Config, rank: int, encoder: TinyViT, work: Workload, store: GlobalStore
) -> dict[str, Any]:
    """Serve this process's share of the steady mix; its numbers."""
    pool = int(config.pool_fraction * work.hot_bytes()) // 4096 * 4096
    server = PipelineServer(MeteredEncoder(encoder), pool, config.best_policy, store=store)
    mine = [(f"{rank}-{n}", r) for n, r in enumerate(work.mixes["steady"]) if n % PROCESSES == rank]
    order = iter(mine)
    lock = threading.Lock()
    latencies: list[float] = []

    def client() -> None:
        lane = Lane()
        while (job := _next(order, lock)) is not None:
            latencies.append(server.serve(job[0], job[1], lane).seconds)
        lane.close()

    print("ready", flush=True)  # the parent answers once every process is ready
    sys.stdin.readline()
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(config.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    stats = server.cache.stats()
    lat = sorted(latencies)
    result = {
        "requests": len(lat),
        "seconds": seconds,
        "requests_per_s": len(lat) / seconds,
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "encoded_images": server.encoder.total.images,
        "global_hits": stats.loads_ok,
        "loads_failed": stats.loads_failed + stats.loads_unknown,
        "publishes_ok": stats.publishes_ok,
        "publishes_failed": stats.publishes_failed,
    }
    server.close()
    return result


def _next(order: Any, lock: threading.Lock) -> Any:
    with lock:
        return next(order, None)


def run_fleet(config: Config) -> dict[str, Any]:
    """Both rows: two processes alone, then two sharing one ``mooncake_master``."""
    from embcache.store.mooncake_master import MooncakeMaster, master_binary

    rows = {"alone": _spawn(config, {})}
    if master_binary() is None:
        return {"rows": rows, "skipped": {**SKIPPED, "shared": "mooncake_master is not installed"}}
    with MooncakeMaster() as master:
        shared = {**master.store_kwargs(), "key_prefix": f"bench-server/{uuid.uuid4().hex[:8]}/"}
        rows["one mooncake_master"] = _spawn(config, shared)
    return {"rows": rows, "skipped": SKIPPED}


def _spawn(config: Config, store: dict[str, str]) -> dict[str, Any]:
    """Run the processes at once; their summed row."""
    from embcache.store.mooncake_master import MooncakeMaster

    env = {**MooncakeMaster.CLIENT_ENVIRONMENT, **os.environ}
    command = [
        sys.executable,
        "-m",
        "benchmarks.server.fleet",
        "--config",
        json.dumps(asdict(config)),
        "--store",
        json.dumps(store),
    ]
    logs = [tempfile.TemporaryFile("w+") for _ in range(PROCESSES)]  # noqa: SIM115 (closed below)
    procs = [
        subprocess.Popen(
            [*command, "--rank", str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=logs[rank],
            text=True,
            env=env,
        )
        for rank in range(PROCESSES)
    ]
    for proc in procs:  # each says "ready" (or ends, failing)
        assert proc.stdout is not None
        proc.stdout.readline()
    outs = [proc.communicate("go\n", timeout=1800)[0] for proc in procs]
    for proc, log in zip(procs, logs, strict=True):
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        if proc.returncode:
            raise RuntimeError(f"a server process failed (exit {proc.returncode}): {tail}")
    each = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    summed: dict[str, Any] = {k: sum(e[k] for e in each) for k in SUMMED}
    summed["requests_per_s"] = summed["requests"] / max(e["seconds"] for e in each)
    summed["p99_ms"] = max(e["p99_ms"] for e in each)
    summed["per_process"] = each
    return summed


def _worker(config: Config, rank: int, store_kwargs: dict[str, str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    encoder = make_encoder(config.hidden)
    work = make_workload(
        encoder, config.hot, config.requests, config.zipf_s, config.seed, ("steady",)
    )
    if not store_kwargs:
        return serve_share(config, rank, encoder, work, NullGlobalStore())
    from embcache.store.mooncake import MooncakeStore

    lend = max(MIN_SEGMENT, work.hot_bytes() // PROCESSES)
    with MooncakeStore(**store_kwargs, global_segment_size=lend) as store:
        store.connect()
        return serve_share(config, rank, encoder, work, store)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full", help="the run's sizes")
    parser.add_argument("--config", default=None, help="a whole Config (JSON; workers)")
    parser.add_argument("--rank", type=int, default=None, help="run as server process RANK")
    parser.add_argument("--store", default="{}", help="MooncakeStore arguments (JSON)")
    args = parser.parse_args(argv)
    config = SIZES[args.size]
    if args.config:
        fields = json.loads(args.config)
        config = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    if args.rank is None:
        print(json.dumps(run_fleet(config), indent=1))
    else:
        print(json.dumps(_worker(config, args.rank, json.loads(args.store))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
