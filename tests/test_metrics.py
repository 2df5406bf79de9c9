"""``embcache.tools.metrics``: a real cache's stats scraped over HTTP and parsed as Prometheus text.

Every exported counter and gauge is compared with ``stats()`` taken after the same requests;
latency histograms count what ``observe_*`` and ``TimedStore`` recorded; bad arguments raise
specific errors and change nothing.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import torch

from embcache import EmbeddingCache, InvalidArgumentError, InvalidTypeError
from embcache.testing import FaultInjectingStore
from tests.support.helpers import item_of, payload

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from embcache.tools.metrics import CacheMetrics, TimedStore, serve  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def scrape() -> Iterator[Callable[[CacheMetrics], Samples]]:
    """Serves a registry holding the collector on a free loopback port and scrapes it."""
    servers = []

    def get(metrics: CacheMetrics) -> Samples:
        registry = prometheus_client.CollectorRegistry()
        registry.register(metrics)
        server = serve(registry, 0)
        servers.append(server)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            text = response.read().decode()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    yield get
    for server in servers:
        server.shutdown()
        server.server_close()


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def run_requests(cache: EmbeddingCache, store: FaultInjectingStore) -> None:
    """Inserts that evict, hits, a miss, and a load from the store of an evicted entry."""
    tensors = [payload((64, 16), torch.float32, seed) for seed in range(6)]  # 4 KiB each
    for i, tensor in enumerate(tensors):
        with cache.request(f"fill-{i}") as req:
            req.lookup([item_of(f"k{i}", tensor)], reserve_misses=True)
            req.insert([f"k{i}"], [tensor])
    with cache.request("hits") as req:
        req.lookup([item_of("k5", tensors[5]), item_of("k4", tensors[4])])
        req.lookup([item_of("absent", tensors[0])])  # a miss, not reserved
    with cache.request("load") as req:
        req.lookup([item_of("k0", tensors[0])], reserve_misses=True)  # evicted, in the store
        req.wait(timeout=5.0)


def test_every_counter_and_gauge_matches_stats(
    scrape: Callable[[CacheMetrics], Samples],
) -> None:
    store = FaultInjectingStore()
    timed_metrics = CacheMetrics()
    cache = EmbeddingCache(  # lru: run_requests' inserts evict (the counters are not all 0)
        4 * 4096, store=TimedStore(store, timed_metrics, "main"), pin_memory=False, policy="lru"
    )
    try:
        run_requests(cache, store)
        timed_metrics.add("main", cache)
        samples = scrape(timed_metrics)
        s = cache.stats()
    finally:
        cache.close()
    main = {"cache": "main"}
    assert s.hits == 2 and s.evictions >= 2 and s.loads_ok == 1, s
    assert value(samples, "embcache_hits_total", **main) == s.hits
    assert value(samples, "embcache_inserts_total", **main) == s.inserts == 6
    assert value(samples, "embcache_evictions_total", **main) == s.evictions
    assert value(samples, "embcache_evicted_bytes_total", **main) == s.evicted_bytes
    assert value(samples, "embcache_loads_started_total", **main) == s.loads_started
    assert value(samples, "embcache_publishes_started_total", **main) == s.publishes_started
    for kind in ("loads", "publishes"):
        for outcome in ("ok", "failed", "unknown"):
            assert value(samples, f"embcache_{kind}_ended_total", outcome=outcome, **main) == (
                getattr(s, f"{kind}_{outcome}")
            )
    for reason, count in s.misses_by_reason.items():
        assert value(samples, "embcache_misses_total", reason=reason, **main) == count
    assert s.misses_by_reason, "the lookup of 'absent' missed"
    for state, count in s.entries_by_state.items():
        assert value(samples, "embcache_entries", state=state, **main) == count
        assert value(samples, "embcache_entry_bytes", state=state, **main) == (
            s.bytes_by_state[state]
        )
    assert value(samples, "embcache_capacity_bytes", **main) == s.capacity_bytes == 4 * 4096
    assert value(samples, "embcache_allocated_bytes", **main) == s.allocated_bytes
    assert value(samples, "embcache_free_bytes", **main) == s.free_bytes
    assert value(samples, "embcache_largest_free_block_bytes", **main) == s.largest_free_block
    assert value(samples, "embcache_fragmentation_ratio", **main) == s.fragmentation
    assert value(samples, "embcache_pinned_entries", **main) == 0
    assert value(samples, "embcache_open_requests", **main) == 0
    # TimedStore timed the one store read of k0.
    image = {"cache": "main", "modality": "image"}
    assert value(samples, "embcache_load_seconds_count", **image) == 1
    assert value(samples, "embcache_load_seconds_bucket", le="+Inf", **image) == 1
    assert 0 < value(samples, "embcache_load_seconds_sum", **image) < 5


def test_two_caches_are_told_apart_by_label(scrape: Callable[[CacheMetrics], Samples]) -> None:
    a = EmbeddingCache(1 << 16, pin_memory=False)
    b = EmbeddingCache(1 << 17, pin_memory=False)
    try:
        metrics = CacheMetrics()
        metrics.add("a", a)
        metrics.add("b", b)
        samples = scrape(metrics)
    finally:
        a.close()
        b.close()
    assert value(samples, "embcache_capacity_bytes", cache="a") == 1 << 16
    assert value(samples, "embcache_capacity_bytes", cache="b") == 1 << 17


def test_observed_latencies_land_in_their_buckets(
    scrape: Callable[[CacheMetrics], Samples],
) -> None:
    cache = EmbeddingCache(1 << 16, pin_memory=False)
    try:
        metrics = CacheMetrics()
        metrics.add("main", cache)
        for seconds in (0.0002, 0.003, 0.003):
            metrics.observe_insert("main", seconds, modality="video")
        metrics.observe_load("main", 0.5)
        samples = scrape(metrics)
    finally:
        cache.close()
    video = {"cache": "main", "modality": "video"}
    assert value(samples, "embcache_insert_seconds_count", **video) == 3
    assert value(samples, "embcache_insert_seconds_bucket", le="0.00025", **video) == 1
    assert value(samples, "embcache_insert_seconds_bucket", le="0.0025", **video) == 1
    assert value(samples, "embcache_insert_seconds_bucket", le="0.005", **video) == 3
    assert math.isclose(value(samples, "embcache_insert_seconds_sum", **video), 0.0062)
    image = {"cache": "main", "modality": "image"}
    assert value(samples, "embcache_load_seconds_bucket", le="0.25", **image) == 0
    assert value(samples, "embcache_load_seconds_bucket", le="0.5", **image) == 1


def test_bad_arguments_raise_and_change_nothing() -> None:
    cache = EmbeddingCache(1 << 16, pin_memory=False)
    try:
        metrics = CacheMetrics()
        metrics.add("main", cache)
        with pytest.raises(InvalidArgumentError, match="'main' is already watched"):
            metrics.add("main", cache)
        with pytest.raises(InvalidArgumentError, match="non-empty"):
            metrics.add("", cache)
        with pytest.raises(InvalidTypeError, match="EmbeddingCache, got str"):
            metrics.add("other", "not a cache")  # type: ignore[arg-type]
        assert metrics.names == ["main"]
        for bad in (-1.0, math.nan, math.inf):
            with pytest.raises(InvalidArgumentError, match="finite and >= 0"):
                metrics.observe_load("main", bad)
        with pytest.raises(InvalidTypeError, match="seconds must be a number"):
            metrics.observe_load("main", "1")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="port must be"):
            serve(prometheus_client.CollectorRegistry(), 70000)
        samples = {
            s.name: s.value
            for family in metrics.collect()
            for s in family.samples
            if s.name == "embcache_load_seconds_count"
        }
        assert samples == {}, "nothing was observed"
    finally:
        cache.close()
