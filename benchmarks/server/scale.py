"""Does embcache's per-request cost stay flat as the pool and its entry count grow?

For each pool size (``Config.scale_pools``: 1, 4 and 8 GiB in the full run), embcache's SGLang
adapter and its ``EncodePipeline`` (the best policy) are filled to the brim with placeholder
entries (keys ``cold-N``, sizes drawn from the catalog's mix, zero bytes: encoding 8 GiB of
embeddings would take this machine most of an hour), then serve the steady mix over a hot set
(``Config.scale_hot`` images) that fits the smallest pool, with ``clients`` threads. So every
size sees the same hit rate, and a miss evicts placeholders: what changes is the pool and the
entry count. The first quarter of the requests warms up; rows give requests/s, p50/p99, the
cache's time per request and per item, and its share of request time. Pools are touched only as
they fill, one contender at a time, and freed before the next.
"""

from __future__ import annotations

import gc
import random
import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.server.contenders import Contender, Lane, PipelineServer, adapter_server
from benchmarks.server.workload import Config, MeteredEncoder
from embcache import EmbeddingCache, Item, Status
from tests.support.server_workload import TOKEN_WEIGHTS, TOKENS, Image, make_encoder, make_workload

PREFILL_BATCH = 64


def prefill(cache: EmbeddingCache, hidden: int, dtype: torch.dtype, seed: int) -> int:
    """Insert placeholder entries until the pool has no room for the largest item; how many."""
    rng = random.Random(seed)
    source = torch.zeros((max(TOKENS), hidden), dtype=dtype)
    row = hidden * dtype.itemsize
    made = 0
    while cache.stats().free_bytes >= 2 * max(TOKENS) * row:
        sizes = rng.choices(TOKENS, TOKEN_WEIGHTS, k=PREFILL_BATCH)
        items = [Item(f"cold-{made + n}", (t, hidden), dtype) for n, t in enumerate(sizes)]
        with cache.request(f"prefill-{made}") as request:
            statuses = request.lookup(items, prefetch=False, reserve_misses=True)
            chosen = [
                i for i, s in zip(items, statuses, strict=True) if s.status is Status.RESERVED
            ]
            request.insert(
                [i.key for i in chosen], [source[: i.shape[0]] for i in chosen], publish=False
            )
        made += len(chosen)
        if len(chosen) < len(items):
            break
    return made


def _cache_of(contender: Contender) -> EmbeddingCache:
    if isinstance(contender, PipelineServer):
        return contender.cache
    cache: EmbeddingCache = getattr(contender, "controller").cache  # noqa: B009
    return cache


def scale_row(contender: Contender, config: Config, requests: list[Any]) -> dict[str, Any]:
    """Fill ``contender``'s pool, serve ``requests`` (a quarter warms up); its row."""
    cache = _cache_of(contender)
    encoder = contender.encoder.encoder
    placeholders = prefill(cache, encoder.hidden_size, encoder.dtype, config.seed)
    warm = len(requests) // 4
    jobs = [(f"scale-{n}", images) for n, images in enumerate(requests)]
    serve_all(contender, jobs[:warm], config.clients)
    measured, seconds = serve_all(contender, jobs[warm:], config.clients)
    lat = sorted(s[0] for s in measured)
    cache_s = [s[1] for s in measured]
    stats = cache.stats()
    return {
        "pool_bytes": stats.capacity_bytes,
        "entries": stats.entries,
        "placeholders": placeholders,
        "requests": len(lat),
        "requests_per_s": len(lat) / seconds,
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "cache_ms_per_request": 1e3 * statistics.fmean(cache_s),
        "cache_us_per_item": 1e6 * sum(cache_s) / sum(s[2] for s in measured),
        "cache_share": sum(cache_s) / sum(lat),
        "evictions": stats.evictions,
    }


def serve_all(
    contender: Contender, jobs: list[tuple[str, list[Image]]], clients: int
) -> tuple[list[tuple[float, float, int]], float]:
    """Serve ``jobs`` with ``clients`` threads: per request (seconds, cache seconds, items),
    and the wall seconds, background work included."""
    order = iter(jobs)
    lock = threading.Lock()
    seen: list[tuple[float, float, int]] = []

    def client() -> None:
        lane = Lane()
        while True:
            with lock:
                job = next(order, None)
            if job is None:
                break
            served = contender.serve(job[0], job[1], lane)
            seen.append((served.seconds, served.cache_seconds, len(job[1])))
        lane.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    contender.finish()
    return seen, time.perf_counter() - start


def run_scale(config: Config) -> dict[str, list[dict[str, Any]]]:
    """Per contender, one row per pool size in ``config.scale_pools``."""
    torch.set_num_threads(1)
    encoder = make_encoder(config.hidden)
    work = make_workload(
        encoder, config.scale_hot, config.scale_requests, config.zipf_s, config.seed, ("steady",)
    )
    requests = work.mixes["steady"]
    makers = {
        f"embcache adapter {config.best_policy}": lambda pool: adapter_server(
            MeteredEncoder(encoder), pool, config.best_policy
        ),
        f"embcache pipeline {config.best_policy}": lambda pool: PipelineServer(
            MeteredEncoder(encoder), pool, config.best_policy
        ),
    }
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
    for pool in config.scale_pools:
        for name, make in makers.items():
            contender = make(pool)
            try:
                rows[name].append(scale_row(contender, config, requests))
            finally:
                contender.close()
                del contender
                gc.collect()
    return rows
