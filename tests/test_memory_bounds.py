"""Memory bounds (embcache/DESIGN.md, "Memory bounds"): each container that grows with keys,
requests or time stays at its stated bound when a test drives far past it.

Private names read here (each the container a bound is about, with no public count):
``cache._core.shapes`` (how many shapes are interned), ``cache._views._typed`` (the pool's
views, one per dtype), ``cache._wakeups`` (wake-ups of open requests),
``cache._outbox._waiting`` (trace batches not yet delivered), ``cache.runner.core._state``
(the core's eviction index and order: that the index was in use where its memory is measured).
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, InvalidArgumentError, Item, Status
from embcache.core import entry_actions
from embcache.core.eviction import INDEX_FROM
from embcache.core.policy import TinyLfuPolicy, make_policy
from embcache.core.state import MAX_SHAPES
from embcache.driver.trace import TraceLog
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import rss

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def push_distinct_images(cache: EmbeddingCache, count: int, start: int, nbytes: int) -> None:
    """``count`` requests, each inserting one new distinct image of ``nbytes`` (fresh bytes)."""
    for i in range(start, start + count):
        key = f"img-{i}"
        with cache.request(f"r{i}") as request:
            assert request.lookup([Item(key, (nbytes,), torch.uint8)])[0].status is Status.MISS
            request.insert([key], [torch.full((nbytes,), i % 251, dtype=torch.uint8)])


def growth_while_pushing(cache: EmbeddingCache, pool: int, nbytes: int) -> tuple[int, int]:
    """RSS and traced-heap growth while 10x the pool passes, after a warm-up of 2x."""
    per_pool = pool // nbytes
    push_distinct_images(cache, 2 * per_pool, 0, nbytes)  # warm-up: full, evicting
    gc.collect()
    tracemalloc.start()
    try:
        rss0, heap0 = rss(), tracemalloc.get_traced_memory()[0]
        push_distinct_images(cache, 10 * per_pool, 2 * per_pool, nbytes)
        gc.collect()
        return rss() - rss0, tracemalloc.get_traced_memory()[0] - heap0
    finally:
        tracemalloc.stop()


def test_the_readme_cache_holds_at_most_its_pool_however_many_images_pass() -> None:
    """``EmbeddingCache(pool_bytes)`` as the README's first example, with ``lru`` so that every
    image enters and evicts (the default's filter refuses one-off images): 10x the pool of
    distinct images pass and neither the process nor Python's heap grows by a fraction of a
    pool."""
    pool, nbytes = 4 * MIB, 64 << 10
    with EmbeddingCache(pool, pin_memory=False, policy="lru") as cache:
        assert cache.store is None
        grew, heap = growth_while_pushing(cache, pool, nbytes)
        stats = cache.stats()
    assert stats.allocated_bytes <= pool and stats.evictions >= 10 * (pool // nbytes)
    assert grew < pool // 4, f"RSS grew by {grew / MIB:.1f} MiB while 40 MiB passed"
    assert heap < 256 << 10, f"the Python heap grew by {heap >> 10} KiB"


def test_the_growth_measure_catches_a_store_that_keeps_everything() -> None:
    """The same run with a store that keeps every publish (the old default): the measure above
    sees it, so the bound test is not one that cannot fail."""
    pool, nbytes = 4 * MIB, 64 << 10
    store = FaultInjectingStore()
    with EmbeddingCache(pool, store=store, pin_memory=False, policy="lru") as cache:
        grew, heap = growth_while_pushing(cache, pool, nbytes)
    store.close()
    assert grew >= pool // 4 or heap >= 256 << 10, (grew, heap)


def push_units(cache: EmbeddingCache, units: list[int], start: int) -> None:
    """One distinct image of ``units[j]`` aligned units (256 bytes each) per ``j``, eight to a
    request; fixed-width keys, so no key grows longer as the numbers grow."""
    payloads = {u: torch.zeros((u * 256,), dtype=torch.uint8) for u in set(units)}
    for first in range(0, len(units), 8):
        keys = [f"img-{start + j:09d}" for j in range(first, min(first + 8, len(units)))]
        sizes = units[first : first + 8]
        with cache.request(f"r{start + first}") as request:
            shapes = zip(keys, sizes, strict=True)
            request.lookup([Item(k, (u * 256,), torch.uint8) for k, u in shapes])
            request.insert(keys, [payloads[u] for u in sizes])


def heap_after_each(cache: EmbeddingCache, phases: list[list[int]], start: int) -> list[int]:
    """The traced heap (``tracemalloc`` must be on) after each phase of inserts."""
    heaps = []
    for units in phases:
        push_units(cache, units, start)
        start += len(units)
        gc.collect()
        heaps.append(tracemalloc.get_traced_memory()[0])
    return heaps


def test_per_entry_tables_reach_their_bound_at_the_most_entries_and_stay_within_it() -> None:
    """The dicts the core keeps per entry (entries, the allocator's maps, the eviction order)
    keep a hash table sized by their count when they last ran out of room (DESIGN.md, "Memory
    bounds"): largest when the pool churns at its capacity in entries, E = capacity /
    alignment. Churned there first (the memory soak's warm-up), 100 E more distinct images of
    mixed sizes (E/2 to E entries resident, through counts near a third of a power of two,
    where a table flips between two sizes) never lift the heap above it. Warmed at E/2 entries
    instead, the same measure sees the heap rise when the count reaches E (twice the entries,
    their tables doubled): the measure can fail."""
    pool = 64 << 10
    e = pool // 256
    mixed = [[1, 2] * e, [2] * 2 * e, [1] * 2 * e, [2, 1, 1] * e, [1, 2, 2] * e]  # 9 E each round
    slack = 16 << 10  # a few KiB of Python's own noise; a table flip here is 20+ KiB
    with EmbeddingCache(pool, pin_memory=False, policy="lru") as cache:
        tracemalloc.start()
        try:
            (warm,) = heap_after_each(cache, [[1] * 8 * e], 0)  # churned at E entries
            heaps = heap_after_each(cache, mixed * 11, 8 * e)  # 99 E
        finally:
            tracemalloc.stop()
        assert cache.stats().evictions >= 100 * e // 2
        cache.check_invariants()
    assert max(heaps) - warm <= slack, [(h - warm) >> 10 for h in heaps]
    with EmbeddingCache(pool, pin_memory=False, policy="lru") as cache:
        tracemalloc.start()
        try:
            (half,) = heap_after_each(cache, [[2] * 4 * e], 0)  # churned at E/2 entries
            (full,) = heap_after_each(cache, [[1] * 8 * e], 4 * e)
        finally:
            tracemalloc.stop()
    assert full - half > 2 * slack, (half, full)


@pytest.mark.parametrize(("policy", "most"), [("lru", 512), ("tinylfu", 1000), ("adaptive", 1200)])
def test_metadata_per_entry_the_pool_can_hold(policy: str, most: int) -> None:
    """The README's "about 0.5 KB of metadata per entry the pool can hold" (lru; DESIGN.md
    states each policy's): a 1 MiB pool churned at its capacity in entries (4096 one-unit
    images, 4x that passing, every per-entry table at its bound), keys of 13 characters."""
    pool = 1 << 20
    e = pool // 256
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        with EmbeddingCache(pool, pin_memory=False, policy=policy) as cache:
            push_units(cache, [1] * 4 * e, 0)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            assert cache.stats().entries == e
    finally:
        tracemalloc.stop()
    assert held <= most * e, f"{held / e:.0f} bytes an entry"


def test_metadata_per_entry_the_pool_can_hold_with_the_eviction_index_in_use() -> None:
    """The lru bound above (512 bytes an entry the pool can hold, E = 4096 in a 1 MiB pool)
    where the core's eviction index is in use (DESIGN.md, "The eviction index"): images of 1
    or 2 units (3 to 1, at random), so the order holds thousands of candidates (past
    ``INDEX_FROM``) and the 2-unit allocations search it for adjacent victims. The index's
    counters say it searched and examined candidates: the bound is measured with its tables
    made and full, not on the scan."""
    pool = 1 << 20
    e = pool // 256
    rng = random.Random(56)
    units = [rng.choice((1, 1, 1, 2)) for _ in range(4 * e)]
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        with EmbeddingCache(pool, pin_memory=False, policy="lru") as cache:
            push_units(cache, units, 0)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            # private: the core's index and order, to show the index was in use (no public count)
            st = cache.runner.core._state
            index, entries = st.index, cache.stats().entries
            assert len(st.order) == entries >= 2 * INDEX_FROM, entries
            assert index is not None and index.searches > e // 4 and index.examined > e // 4
    finally:
        tracemalloc.stop()
    assert held <= 512 * e, f"{held / e:.0f} bytes an entry ({entries} entries)"


def test_interned_shapes_stay_at_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """10x the bound of distinct shapes pass: the interning table never holds more (the bound
    shrunk to 64 for the test, as sortedcontainers' tests shrink their load factor)."""
    assert MAX_SHAPES == 4096
    monkeypatch.setattr(entry_actions, "MAX_SHAPES", 64)  # (where BeginLoad reads it)
    with EmbeddingCache(1 << 16, pin_memory=False) as cache:
        most = 0
        for i in range(10 * 64):
            key = f"k{i}"
            with cache.request(f"r{i}") as request:
                request.lookup([Item(key, (1, 1 + i), torch.uint8)])
                request.insert([key], [torch.zeros((1, 1 + i), dtype=torch.uint8)])
            most = max(most, cache.sizes()["shapes"])
        cache.check_invariants()
    assert most == 64


def test_pool_views_and_strides_stay_at_their_bound() -> None:
    """10x the strides cache's 1024 distinct shapes, in three dtypes, pass through a cache:
    one pool view per dtype, at most ``MAX_BASES`` base views, and the strides cache (one per
    process) full at its bound of 1024, not past it."""
    from embcache.driver.pool import PoolViews

    dtypes = (torch.uint8, torch.float16, torch.float32)
    with EmbeddingCache(1 << 16, pin_memory=False, policy="lru") as cache:
        for i in range(10 * 1024):
            key, dtype = f"k{i}", dtypes[i % 3]
            with cache.request(f"r{i}") as request:
                request.lookup([Item(key, (1, 1 + i % 4096), dtype)])
                request.insert([key], [torch.zeros((1, 1 + i % 4096), dtype=dtype)])
                request.embeddings()
        sizes = cache.sizes()
        assert sizes["typed_views"] == 3
        assert sizes["view_bases"] <= PoolViews.MAX_BASES == 256
        assert sizes["strides"] == 1024, sizes  # 4096 shapes went through it


def test_wakeups_fences_and_trace_batches_empty_when_requests_close() -> None:
    """Requests that waited on loads, fences and traced steps: once every request closes and
    every fence returns, no wake-up, fence snapshot or undelivered trace batch is left."""
    store, trace = FaultInjectingStore(), TraceLog()
    payload = torch.arange(64, dtype=torch.float32)
    for i in range(300):
        store.put_object(f"s{i}", payload.numpy().tobytes())
        if i % 3 == 0:
            store.inject(f"s{i}", Fault.UNKNOWN)  # quarantined, freed by a fence
    with EmbeddingCache(32 * 256, store=store, pin_memory=False, trace=trace) as cache:
        for i in range(300):
            with cache.request(f"r{i}") as request:
                request.lookup([Item(f"s{i}", (64,), torch.float32)])
                assert request.wait(timeout=10)
            if i % 50 == 49:
                cache.fence()
        cache.fence()
        assert cache.stats().open_requests == 0
        sizes = cache.sizes()
        assert sizes["wakeups"] == sizes["async_waiters"] == 0
        assert sizes["fences_in_flight"] == 0
        assert sizes["trace_batches"] == 0
        cache.check_invariants()
    assert len(trace.events) > 300
    store.close()


def test_metrics_label_pairs_are_bounded() -> None:
    """The 65th (cache, modality) pair is refused with a clear error and records nothing."""
    pytest.importorskip("prometheus_client")
    from embcache.tools.metrics import CacheMetrics

    metrics = CacheMetrics()
    for i in range(CacheMetrics.MAX_LABEL_PAIRS):
        metrics.observe_load("c", 0.01, modality=f"m{i}")
    metrics.observe_insert("c", 0.01, modality="m0")  # a pair already there: fine
    with pytest.raises(InvalidArgumentError, match=r"already hold 64 .cache, modality. label"):
        metrics.observe_insert("c", 0.01, modality="one-too-many")
    series = {
        sample.labels.get("modality")
        for family in metrics.collect()
        for sample in family.samples
        if sample.name.startswith(("embcache_load", "embcache_insert"))
    }
    assert "one-too-many" not in series and len(series - {None}) == 64


def _soak(*front_ends: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak.memory", "--quick", "--json", "--front-end",
         *front_ends],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_memory_soak_cache_and_pipeline_quick() -> None:
    """benchmarks/soak/memory.py --quick: 20,000 distinct items through a 0.25 MiB pool, RSS
    growth < 5% and the heap never above the warm-up's (at every further tenth and the end),
    no request left open."""
    out = _soak("cache", "pipeline")
    rows = out["rows"]
    assert isinstance(rows, list) and [r["front_end"] for r in rows] == ["cache", "pipeline"]
    for row in rows:
        assert row["rss_growth_pct"] < 5 and row["heap_rise_kib"] <= 256, row
        assert row["containers"]["open_requests"] == 0, row
        assert row["containers"]["entries"] <= out["pool_bytes"] // 256, row


@pytest.mark.mooncake
def test_memory_soak_sglang_adapter_quick() -> None:
    """The SGLang adapter through MMEncoder's sequence on a real master: flat, holds empty."""
    pytest.importorskip("mooncake.store")
    from embcache.store.mooncake_master import find_master_binary

    if find_master_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("mooncake_master must be installed in CI")
        pytest.skip("mooncake_master is not on PATH")
    out = _soak("sglang")
    (row,) = out["rows"]  # type: ignore[misc]
    assert row["rss_growth_pct"] < 5 and row["heap_rise_kib"] <= 256, row
    holds = {k: v for k, v in row["containers"].items() if k.startswith("holds_")}
    assert holds and not any(holds.values()), row


# ---------------------------------------------------------------------------- policies
class ForgetKeepsTheExactCount(TinyLfuPolicy):
    """A planted bug (issue 42): ``forget`` writes the exact count back into the sketch but
    keeps it in the exact-count dict, which then grows past "at most the resident keys"."""

    def forget(self, key: str) -> None:
        self._resident.discard(key)
        count = self._counts.get(key)
        if count is not None:
            self._sketch.raise_to(key, count)


def drive_every_path(policy: Any, units: int = 16, requests: int = 12_000) -> dict[str, int]:
    """A real cache of ``units`` one-unit entries under ``policy``, driven down every path that
    grows a policy's containers, checking after every request that ``policy.footprint()`` (each
    container counted) stays within ``policy.bound(units)`` and that the policy keeps no more
    resident keys or exact counts than the cache holds entries. Each request looks up (and
    inserts what missed):
    - a hot set of 4 keys, looked up while resident (hits: exact counts), which moves to new
      keys every 3,000 requests (a phase change: the shift detector clears the counts);
    - one of 48 recurring keys, 3x the pool: evicted, then looked up and readmitted, so its
      exact count goes back into the sketch and is counted again;
    - one key never seen before (far past every bound: 12,000 of them);
    and every 500 requests, 100 request-less inserts of new keys (admission asked with no
    lookup: no period ends to prune ``adaptive``'s ghosts). Every insert says its encoder
    work (``adaptive-work`` keeps it; the others ignore it). Many lookups end samples
    (halvings). Returns the most each container held and how often each path ran."""
    most = {"sketch_bytes": 0, "resident": 0, "counts": 0, "ghosts": 0, "work": 0}
    most["work_ghosts"] = 0
    seen: set[str] = set()
    readmitted = hits = 0
    bound = policy.bound(units)
    with EmbeddingCache(units * 256, pin_memory=False, policy=policy) as cache:
        for n in range(requests):
            keys = [f"hot{n // 3000}-{j}" for j in range(4)]
            keys += [f"back{n % 48}", f"new{n:08d}"]
            with cache.request(f"r{n}") as request:
                statuses = request.lookup([Item(key, (256,), torch.uint8) for key in keys])
                missed = [k for k, s in zip(keys, statuses, strict=True) if s.status is Status.MISS]
                hits += len(keys) - len(missed)
                readmitted += sum(key in seen for key in missed)
                seen.update(missed)
                tensors = [torch.full((256,), n % 251, dtype=torch.uint8)] * len(missed)
                request.insert(missed, tensors, work=[0.001 * (1 + n % 7)] * len(missed))
            if n % 500 == 499:  # request-less inserts: admissions with no lookup
                for j in range(100):
                    put = [torch.zeros((256,), dtype=torch.uint8)]
                    cache.insert([f"put{n}-{j}"], put, work=[0.002])
            now = policy.footprint()
            entries = cache.stats().entries
            assert now.within(bound), (n, now, bound)
            assert now.counts <= now.resident <= entries, (n, now, entries)
            assert now.work <= entries, (n, now, entries)
            for field in most:
                most[field] = max(most[field], getattr(now, field))
        cache.check_invariants()
    return {**most, "hits": hits, "readmitted": readmitted}


@pytest.mark.parametrize("name", ["tinylfu", "adaptive", "adaptive-work"])
def test_every_policy_container_stays_at_its_bound_down_every_path(name: str) -> None:
    """Issue 42: lookups of resident keys, evictions and readmissions, halvings and shifts, and
    12,000 distinct keys looked up and 2,400 inserted with no request (750x and 150x the 16
    entries; the sketch's bound: 4 rows of 4,096 counters; the ghosts': 64, tinylfu's: 0) keep
    every container within the bound, and the paths did run: hits, keys
    readmitted, samples halved, shifts cleared the counts, and the exact counts, (adaptive)
    ghosts and (adaptive-work) remembered work filled up. Samples of 50 x 16 lookups and blocks
    of 12 (``shift_block``), so that each move of the hot set shows in a block before its new
    keys' counts build up."""
    policy: Any = make_policy(name, sample_factor=50, shift_block=12)
    got = drive_every_path(policy)
    bound = policy.bound(16)
    assert got["hits"] > 10_000 and got["readmitted"] > 1_000, got
    assert policy.halvings > 10 and policy.shifts >= 2, (policy.halvings, policy.shifts)
    assert got["sketch_bytes"] == bound.sketch_bytes and got["resident"] == 16, got
    assert got["counts"] >= 4, got  # the hot set, at least, counted exactly
    assert got["ghosts"] == bound.ghosts, got  # adaptive: 64 reached (2,400 inserts passed)
    # adaptive-work: every entry's work (16) and its ghosts' (4 x 16) reached; others keep none
    assert (got["work"], got["work_ghosts"]) == (bound.work, bound.work_ghosts), got


def test_the_bound_test_catches_a_forget_that_keeps_the_exact_count() -> None:
    """The plant of issue 42 (``ForgetKeepsTheExactCount``): the drive above fails on it, as
    soon as the exact counts outnumber the resident keys."""
    with pytest.raises(AssertionError, match="counts="):
        drive_every_path(ForgetKeepsTheExactCount(sample_factor=50, shift_block=12))
