"""Against the peers' own code: SGLang 0.5.23's paged controller and the original PR's controller.

SGLang's ``EmbeddingCacheController`` runs from its wheel (``tests.support.sglang_wheel``; rows say
skipped when the wheel cannot be had), with its IO thread stopped (no global store traffic is
measured; its 1 ms poll would only steal the CPU from both sides). It is driven
(``tests.support.sglang_wheel.SGLangPeer``) through its own methods: ``batch_is_exist``,
``prefetch``, ``check_prefetch_progress``, ``get_pool_views`` and ``release_pool_views`` as its
scheduler calls them, and for an insert the steps of ``store_to_pool_async`` +
``wait_store_to_pool`` (which take CUDA tensors only) with a CPU tensor: under its lock
``_allocate_with_eviction`` and a FILLING ``EmbeddingCacheEntry``, the copy by its
``_copy_embedding_page_runs`` (its CPU path), then ``_mark_ready`` under its lock. The original
PR's controller is ``tests.support.baselines.OriginalPRController``. Ours is ``EmbeddingCache``
through its public API. Every comparison runs side by side in one process, in chunks that alternate
between the contenders; medians. Ratios are peer time / our time (below 1: ours is slower), bytes
are ours / peer's.

- ``evicting_sides``: the evicting insert of ``bench_eviction`` (uniform 256 B entries, the
  oldest half pinned) for SGLang with 256 B pages (one entry a page).
- ``replay_rows``: the request stream of ``bench_fragmentation`` (Zipf popularity, 1-3 images a
  request, 4 requests held open) on a 4 MiB pool with entries of 64..4096 tokens x 14 B against
  SGLang with 1 KiB pages, and on a 1 GiB pool at the real sizes (3584 hidden, bf16 or fp32;
  copies included) against SGLang's own 256 KiB pages. A request pins its hits, inserts its
  misses (pinned too) and takes every view; it is released 4 requests later.
- ``hit_rows``: 8 hits a request over N idle 256 B entries: the serving sequence (exists,
  prefetch, progress, get, release; ours: ``lookup``, ``wait``, ``embeddings``, close) and get +
  release only (ours: ``lookup(prefetch=False)``, ``embeddings``, close).
- ``metadata_rows``: tracemalloc bytes per entry of the peers at N idle 256 B entries.
Run from the repository root: python -m benchmarks.peers.bench_peers [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import hex_keys, make_row, print_rows, skipped_row, traced_bytes
from benchmarks.micro import bench_fragmentation as frag
from embcache import EmbeddingCache, Item, Request, Status
from tests.support import mixes, sglang_wheel
from tests.support.baselines import OriginalPRController
from tests.support.sglang_wheel import SGLangPeer

MIXED_POOL = 4 << 20
MIXED_TOKEN_BYTES = 14  # 7 bf16 values a token
MIXED_PAGE = 1024
REAL_POOL = 1 << 30
ENTRY_BYTES = 256
BATCH = 8
SGLANG = "SGLang paged"
PR = "original PR"


def sglang_missing() -> str | None:
    """Why SGLang's rows cannot run here, or None when its wheel loads."""
    try:
        sglang_wheel.load_controller_module()
    except sglang_wheel.SGLangUnavailable as exc:
        return str(exc)
    return None


def chunked(sides: dict[str, Callable[[int], None]], ops: int, chunks: int) -> dict[str, float]:
    """Median seconds per op of each side; chunks of ``ops`` alternate over the sides (the
    first chunk warms up). Each side's op gets a running op number."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    done = dict.fromkeys(sides, 0)
    for chunk in range(chunks + 1):
        for name, op in sides.items():
            start = time.perf_counter()
            for n in range(done[name], done[name] + ops):
                op(n)
            elapsed = (time.perf_counter() - start) / ops
            done[name] += ops
            if chunk:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


# ---------------------------------------------------------------------------- evicting insert
def sglang_evicting_side(entries: int, tensor: torch.Tensor) -> Callable[[int], None]:
    """SGLang with ``entries`` pages of 256 B, full: the oldest half pinned (views taken and
    never released), the newer half idle. The op inserts a fresh key (evicting the oldest idle
    entry); the entry is idle once copied, as ours is once its request closes."""
    peer = SGLangPeer(entries * ENTRY_BYTES, ENTRY_BYTES // 2, torch.bfloat16, ENTRY_BYTES)
    assert peer.pool.num_pages == entries and peer.pool.page_size == 1
    half = entries // 2
    for i in range(entries):
        assert peer.insert(f"{'old' if i < half else 'new'}{i}", tensor)
    peer.get([f"old{i}" for i in range(half)])
    assert peer.pool.allocator.free_pages == 0 and len(peer.pool.evictable) == entries - half

    def op(n: int) -> None:
        assert peer.insert(f"fresh{n}", tensor)

    return op


# ---------------------------------------------------------------------------- request streams
class Replay:
    """One contender replaying a request stream: pins its hits, inserts its misses, takes every
    view, holds ``inflight`` requests open."""

    def __init__(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]], inflight: int):
        self.specs = specs
        self.inflight = inflight
        self.failed = 0
        self.hits = 0
        self.lookups = 0

    def request(self, n: int, indices: list[int]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class OursReplay(Replay):
    def __init__(
        self,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        inflight: int,
        pool_bytes: int,
        sources: dict[torch.dtype, torch.Tensor],
        trace: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(specs, inflight)
        self.cache = EmbeddingCache(
            pool_bytes,
            alignment=mixes.ALIGN,
            max_eviction_batch=frag.MAX_BATCH,
            pin_memory=False,
            io_workers=1,
            trace=trace,
            policy="lru",  # like for like with SGLang's LRU: every fresh output is inserted
        )
        self.items = [Item(key, shape, dtype) for key, shape, dtype in specs]
        self.sources = sources
        self.open: deque[Request] = deque()

    def request(self, n: int, indices: list[int]) -> None:
        items = [self.items[i] for i in indices]
        request = self.cache.request(f"r{n}")
        statuses = request.lookup(items, prefetch=False, reserve_misses=True)
        self.failed += sum(st.status not in (Status.HIT, Status.RESERVED) for st in statuses)
        reserved = [
            it for it, st in zip(items, statuses, strict=True) if st.status is Status.RESERVED
        ]
        if reserved:
            tensors = [
                self.sources[it.dtype][: it.nbytes // it.dtype.itemsize].view(it.shape)
                for it in reserved
            ]
            self.failed += sum(
                not ok for ok in request.insert([it.key for it in reserved], tensors, publish=False)
            )
        request.embeddings()
        self.lookups += len(items)
        self.hits += sum(st.status is Status.HIT for st in statuses)
        self.open.append(request)
        if len(self.open) > self.inflight:
            self.open.popleft().close()

    def finish(self) -> None:
        while self.open:
            self.open.popleft().close()
        self.cache.check_invariants()
        self.cache.close()


class SGLangReplay(Replay):
    def __init__(
        self,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        inflight: int,
        peer: SGLangPeer,
        sources: dict[torch.dtype, torch.Tensor],
    ) -> None:
        super().__init__(specs, inflight)
        self.peer = peer
        self.sources = sources
        self.open: deque[list[str]] = deque()

    def request(self, n: int, indices: list[int]) -> None:
        keys = [self.specs[i][0] for i in indices]
        views = self.peer.get(keys)  # pins the hits
        held = [key for key, view in zip(keys, views, strict=True) if view is not None]
        fresh = []
        for i, view in zip(indices, views, strict=True):
            if view is None:
                key, shape, dtype = self.specs[i]
                tensor = self.sources[dtype][: shape[0] * shape[1]].view(shape)
                if self.peer.insert(key, tensor):
                    fresh.append(key)
                else:
                    self.failed += 1
        if fresh:
            self.peer.get(fresh)  # pins what it inserted, as ours holds its inserts
        self.lookups += len(keys)
        self.hits += len(held)
        self.open.append(held + fresh)
        if len(self.open) > self.inflight:
            self.peer.release(self.open.popleft())

    def finish(self) -> None:
        while self.open:
            self.peer.release(self.open.popleft())
        controller = self.peer.controller
        assert not any(entry.ref_count for entry in controller.entries.values())


def stream_specs(
    workload: mixes.Workload, real: bool
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Each image's (key, shape, dtype): real sizes, or ``MIXED_TOKEN_BYTES`` a token (bf16)."""
    if real:
        return [(s.key, (s.tokens, mixes.HIDDEN), s.dtype) for s in workload.specs]
    width = MIXED_TOKEN_BYTES // 2
    return [(s.key, (s.tokens, width), torch.bfloat16) for s in workload.specs]


def wasted_bytes(
    workload: mixes.Workload, specs: Any, pool_bytes: int, sources: Any
) -> tuple[int, int]:
    """Ours' failed inserts and bytes evicted for nothing on the stream (a traced run, untimed)."""
    tally = frag.Tally()
    trace: list[dict[str, Any]] = []
    shadow = frag.Shadow(tally)
    ours = OursReplay(specs, workload.inflight, pool_bytes, sources, trace)
    for n, indices in enumerate(workload.requests):
        ours.request(n, indices)
        shadow.consume(trace)
    ours.finish()
    shadow.consume(trace)
    return tally.failures, tally.wasted_bytes


def replay_rows(quick: bool, real: bool) -> list[dict[str, Any]]:
    """Time per request of ours and SGLang on the stream (4 MiB pool at 14 B a token, or the
    1 GiB pool at real sizes), chunks alternating; failures and hit ratio alongside."""
    scale = "1 GiB pool, real sizes" if real else "4 MiB pool, 64..4096 tokens x 14 B"
    page = sglang_wheel.DEFAULT_PAGE_BYTES if real else MIXED_PAGE
    name = f"request, {scale}, vs {SGLANG} {page // 1024} KiB pages"
    why = sglang_missing()
    if why is not None:
        return [skipped_row(name, why, ">= 1.0x")]
    workload = mixes.make_workload(quick)
    if real and quick:
        workload = mixes.Workload(workload.specs, workload.requests[:120], workload.inflight)
    specs = stream_specs(workload, real)
    pool_bytes = REAL_POOL if real else MIXED_POOL
    largest = max(shape[0] * shape[1] for _, shape, _ in specs)
    sources = {d: torch.zeros(largest, dtype=d) for d in (torch.bfloat16, torch.float32)}
    dim = mixes.HIDDEN if real else MIXED_TOKEN_BYTES // 2
    peer = SGLangPeer(pool_bytes, dim, torch.bfloat16, page)
    contenders: dict[str, Replay] = {
        "ours": OursReplay(specs, workload.inflight, pool_bytes, sources),
        "sglang": SGLangReplay(specs, workload.inflight, peer, sources),
    }
    requests = workload.requests
    per_chunk = 20 if real else 50
    sides = {
        key: (lambda n, replay=replay: replay.request(n, requests[n]))
        for key, replay in contenders.items()
    }
    chunks = len(requests) // per_chunk - 1
    cost = chunked(sides, per_chunk, chunks)
    for replay in contenders.values():
        replay.finish()
    ours, sglang = contenders["ours"], contenders["sglang"]
    rows = [
        make_row(
            name,
            cost["ours"] * 1e6,
            cost["sglang"] * 1e6,
            "us/req",
            cost["sglang"] / cost["ours"],
            ">= 1.0x",
            cost["sglang"] >= cost["ours"],
        ),
    ]
    if not real:  # the trace tells what was evicted for nothing; a second, untimed run
        timed = mixes.Workload(
            workload.specs, requests[: (chunks + 1) * per_chunk], workload.inflight
        )
        failures, wasted = wasted_bytes(timed, specs, pool_bytes, sources)
        assert failures == ours.failed  # same calls, same decisions
        rows.append(
            frag.row(
                f"evicted for nothing, {scale}", wasted / 2**20, 0.0, "MiB", "= 0", wasted == 0
            )
        )
        rows[-1].update(baseline=None, ratio=None)
    rows.append(
        frag.row(
            f"failed inserts, {scale}, vs {SGLANG}",
            ours.failed,
            sglang.failed,
            "inserts",
            "= 0",
            ours.failed == 0,
        )
    )
    rows.append(
        frag.row(
            f"hit ratio, {scale}, vs {SGLANG}",
            100 * ours.hits / ours.lookups,
            100 * sglang.hits / sglang.lookups,
            "%",
            "",
            None,
        )
    )
    return rows


# ---------------------------------------------------------------------------- hit path
def hit_rows(quick: bool) -> list[dict[str, Any]]:
    """us per item of the serving sequence and of get + release, ours against both peers."""
    entries = 1_000 if quick else 10_000
    requests, chunks = (100, 5) if quick else (400, 9)
    keys = [f"img{i:08d}" for i in range(entries)]
    items = {key: Item(key, (ENTRY_BYTES // 2,), torch.bfloat16) for key in keys}
    source = torch.zeros(ENTRY_BYTES // 2, dtype=torch.bfloat16)
    rng = random.Random(entries)
    batches = [
        [keys[rng.randrange(entries)] for _ in range(BATCH)] for _ in range(requests * (chunks + 1))
    ]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(
            EmbeddingCache(
                entries * ENTRY_BYTES, alignment=ENTRY_BYTES, pin_memory=False, io_workers=1
            )
        )
        with cache.request("fill") as fill:
            for start in range(0, entries, 256):
                chunk = keys[start : start + 256]
                assert all(fill.insert(chunk, [source] * len(chunk), publish=False))
        pr = OriginalPRController(entries * ENTRY_BYTES, ENTRY_BYTES)
        for key in keys:
            assert pr.insert(key, source)
        tokens = [1] * BATCH

        def ours_serving(n: int) -> None:
            with cache.request(f"s{n}") as request:
                request.lookup([items[k] for k in batches[n]])
                request.wait()
                request.embeddings()

        def ours_get(n: int) -> None:
            with cache.request(f"g{n}") as request:
                request.lookup([items[k] for k in batches[n]], prefetch=False)
                request.embeddings()

        def pr_serving(n: int) -> None:
            batch = batches[n]
            pr.batch_is_exist(batch)
            pr.prefetch(f"s{n}", batch)
            pr.check_prefetch_progress(f"s{n}")
            pr.get_pool_views(batch)
            pr.release_pool_views(batch)

        def pr_get(n: int) -> None:
            pr.get_pool_views(batches[n])
            pr.release_pool_views(batches[n])

        sides: dict[str, Callable[[int], None]] = {
            "ours serving": ours_serving,
            "ours get": ours_get,
            f"{PR} serving": pr_serving,
            f"{PR} get": pr_get,
        }
        why = sglang_missing()
        if why is None:
            peer = SGLangPeer(entries * ENTRY_BYTES, ENTRY_BYTES // 2, torch.bfloat16, ENTRY_BYTES)
            for key in keys:
                assert peer.insert(key, source)

            def sglang_serving(n: int) -> None:
                batch = batches[n]
                assert all(peer.exists(batch))
                peer.prefetch(f"s{n}", batch, tokens)
                peer.progress(f"s{n}")
                peer.get(batch)
                peer.release(batch)

            def sglang_get(n: int) -> None:
                peer.get(batches[n])
                peer.release(batches[n])

            sides[f"{SGLANG} serving"] = sglang_serving
            sides[f"{SGLANG} get"] = sglang_get
        cost = chunked(sides, requests, chunks)
        cache.check_invariants()
    for what, label in (("serving", "the serving sequence"), ("get", "get + release")):
        for peer_name in (PR, SGLANG):
            name = f"hit, {BATCH} items, {label}, {entries} entries, vs {peer_name}"
            key = f"{peer_name} {what}"
            if key not in cost:
                rows.append(skipped_row(name, why or "", ">= 1.0x"))
                continue
            ours_t, peer_t = cost[f"ours {what}"] / BATCH, cost[key] / BATCH
            rows.append(
                make_row(
                    name,
                    ours_t * 1e6,
                    peer_t * 1e6,
                    "us/item",
                    peer_t / ours_t,
                    ">= 1.0x",
                    peer_t >= ours_t,
                )
            )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    print_rows(hit_rows(quick) + replay_rows(quick, real=False) + replay_rows(quick, real=True))


# ---------------------------------------------------------------------------- metadata
def metadata_rows(quick: bool, ours_per_entry: float) -> list[dict[str, Any]]:
    """Bytes per entry (tracemalloc) of each peer holding N idle 256 B entries, keyed by 64-hex
    digests made inside the traced region, against ``ours_per_entry`` (bench_metadata's)."""
    entries = 20_000 if quick else 100_000
    source = torch.zeros(ENTRY_BYTES // 2, dtype=torch.bfloat16)
    rows = []
    pr = OriginalPRController(entries * ENTRY_BYTES, ENTRY_BYTES)

    def fill_pr() -> OriginalPRController:
        for key in hex_keys(entries):
            assert pr.insert(key, source)
        return pr

    peers: dict[str, Callable[[], Any]] = {PR: fill_pr}
    why = sglang_missing()
    if why is None:
        peer = SGLangPeer(entries * ENTRY_BYTES, ENTRY_BYTES // 2, torch.bfloat16, ENTRY_BYTES)

        def fill_sglang() -> SGLangPeer:
            for key in hex_keys(entries):
                assert peer.insert(key, source)
            return peer

        peers[SGLANG] = fill_sglang
    for peer_name in (PR, SGLANG):
        name = f"metadata per entry, {entries} entries, vs {peer_name}"
        if peer_name not in peers:
            rows.append(skipped_row(name, why or "", ""))
            continue
        used, _ = traced_bytes(peers[peer_name])
        per_entry = used / entries
        rows.append(
            make_row(
                name, ours_per_entry, per_entry, "B/entry", ours_per_entry / per_entry, "", None
            )
        )
    return rows
