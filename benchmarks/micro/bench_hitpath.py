"""Hit path: lookup + pin + view + release per item, against a bare dict and an OrderedDict move.

The cache holds N idle READY entries (256 bytes each). Each timed request opens, looks up
``BATCH`` keys drawn uniformly at random (prefetch off: all hits), takes its zero-copy views
(``embeddings()``) and closes (releasing every pin); the cost is divided by ``BATCH``. The
baseline does, per item, what a cache at its barest must: ``dict[key]`` and
``OrderedDict.move_to_end(key)`` over the same N keys and the same key sequence. A second,
informational baseline also builds the same torch view (one ``as_strided`` of the pool viewed
as the item's dtype, as the cache does), the part of our path that is torch's and not ours.
Every N's cache is built first; then chunks alternate over N and contenders (so load drift on a
shared machine hits them alike); medians.
Flat in N is judged as ours at the largest N over ours at the smallest. The dict rows are
context, without a target: a hit hands out a torch view, which alone costs several dict
lookups. The targets of the hit path are against the peers' own code
(``benchmarks.peers.bench_peers.hit_rows``: SGLang's paged controller and the original PR's).
Run from the repository root: python -m benchmarks.micro.bench_hitpath [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import growth_row, insert_all, make_row, print_rows
from embcache import EmbeddingCache, Item, Status

ENTRY_BYTES = 256
SHAPE = (ENTRY_BYTES // 2,)
BATCH = 8  # items per request
FLAT_GROWTH = 1.5  # ours at the largest N over the smallest


def _per_item(batches: list[list[Any]], body: Callable[[int, list[Any]], None]) -> float:
    start = time.perf_counter()
    for n, batch in enumerate(batches):
        body(n, batch)
    return (time.perf_counter() - start) / (len(batches) * BATCH)


Body = Callable[[int, list[Any]], None]


def contenders(
    stack: contextlib.ExitStack, entries: int, requests: int
) -> tuple[tuple[Body, Body, Body], list[list[Item]]]:
    """Ours (a filled cache of ``entries``), bare dict + move, bare dict + move + torch view;
    and ``requests`` batches of keys drawn uniformly."""
    items = [Item(f"img{i:08d}", SHAPE, torch.bfloat16) for i in range(entries)]
    rng = random.Random(entries)
    batches = [[items[rng.randrange(entries)] for _ in range(BATCH)] for _ in range(requests)]
    source = torch.zeros(SHAPE, dtype=torch.bfloat16)
    cache = stack.enter_context(
        EmbeddingCache(entries * ENTRY_BYTES, alignment=ENTRY_BYTES, pin_memory=False, io_workers=1)
    )
    stack.callback(cache.check_invariants)
    with cache.request("fill") as fill:
        insert_all(fill, [it.key for it in items], source)
    offsets = {it.key: i * ENTRY_BYTES for i, it in enumerate(items)}
    table = dict(offsets)
    recency: OrderedDict[str, int] = OrderedDict(offsets)
    typed_pool = cache.pool.view(torch.bfloat16)
    itemsize = torch.bfloat16.itemsize

    def ours(n: int, batch: list[Item]) -> None:
        with cache.request(f"r{n}") as request:
            statuses = request.lookup(batch, prefetch=False)
            views = request.embeddings()
        assert statuses[0].status is Status.HIT and views[0] is not None

    def bare(_: int, batch: list[Item]) -> None:
        for item in batch:
            table[item.key]
            recency.move_to_end(item.key)

    def bare_view(_: int, batch: list[Item]) -> None:
        for item in batch:
            offset = table[item.key]
            recency.move_to_end(item.key)
            typed_pool.as_strided(item.shape, (1,), offset // itemsize)

    return (ours, bare, bare_view), batches


def measure(sizes: list[int], requests: int, chunks: int) -> dict[int, tuple[float, float, float]]:
    """Median seconds per item for each N: ours, bare dict + move, bare dict + move + view.
    Every N's cache is built first, then chunks alternate over N and contenders."""
    with contextlib.ExitStack() as stack:
        setups = {entries: contenders(stack, entries, requests * chunks) for entries in sizes}
        times: dict[int, tuple[list[float], ...]] = {entries: ([], [], []) for entries in sizes}
        for bodies, batches in setups.values():  # warm up
            for body in bodies:
                _per_item(batches[:50], body)
        for c in range(chunks):
            for entries, (bodies, batches) in setups.items():
                chunk = batches[c * requests : (c + 1) * requests]
                for i, body in enumerate(bodies):
                    times[entries][i].append(_per_item(chunk, body))
    return {
        entries: (statistics.median(t[0]), statistics.median(t[1]), statistics.median(t[2]))
        for entries, t in times.items()
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Per N: us per item, ours vs bare dict+move (ratio = ours / bare) and vs bare
    dict+move+view (both context, no target); growth of ours over N (flat)."""
    sizes = [1_000, 10_000] if quick else [1_000, 10_000, 100_000]
    requests, chunks = (200, 5) if quick else (1000, 7)
    rows, ours_at = [], {}
    for entries, (ours_t, bare_t, view_t) in measure(sizes, requests, chunks).items():
        ours_at[entries] = ours_t
        ratio = ours_t / bare_t
        rows.append(
            make_row(
                f"hit path, {entries} entries, vs dict+move",
                ours_t * 1e6,
                bare_t * 1e6,
                "us/item",
                ratio,
                "",
                None,
            )
        )
        rows.append(
            make_row(
                f"hit path, {entries} entries, vs dict+move+view",
                ours_t * 1e6,
                view_t * 1e6,
                "us/item",
                ours_t / view_t,
                "",
                None,
            )
        )
    rows.append(growth_row("hit path", sizes, ours_at, "entries", FLAT_GROWTH))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print_rows(run(parser.parse_args().quick))
