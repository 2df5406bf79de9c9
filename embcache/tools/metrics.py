"""Prometheus metrics for embedding caches (optional extra: ``pip install 'embcache[metrics]'``).

``CacheMetrics`` is a collector: at every scrape it reads ``stats()`` of each cache it watches
and reports the counters and gauges below, labelled ``cache`` with the name it was given. The
cache has no timing of its own, so load and insert latency are histograms that the caller
feeds (``observe_load``, ``observe_insert``) with a ``modality`` label; ``TimedStore`` feeds
``observe_load`` by timing the store reads of a ``GlobalStore`` it wraps, and
``EncodePipeline(on_insert=...)`` can feed ``observe_insert``.

Counters (``*_total``): hits, misses by reason, fallbacks by reason, loads started and ended by
outcome, inserts, publishes started and ended by outcome, evictions and evicted bytes,
allocation failures by reason, single-flight joins, fences, failed publishes dropped from the
backlog (the oldest beyond its bound; stale: evicted, removed or quarantined first). Gauges: pool
capacity, allocated, free and largest free block in bytes, fragmentation, entries and bytes by
state, pinned entries and bytes, age of the oldest pin, open requests, the publish backlog.

A scrape costs one ``stats()`` per cache: O(entries) under the cache lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from wsgiref.simple_server import WSGIServer

import torch

from embcache.driver.cache import CacheStats, EmbeddingCache
from embcache.driver.global_store import GlobalStore, TransferOutcome
from embcache.errors import InvalidArgumentError, InvalidTypeError

try:
    from prometheus_client import CollectorRegistry, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"embcache.tools.metrics needs prometheus_client ({exc}): pip install 'embcache[metrics]'"
    ) from exc

__all__ = ["LATENCY_BUCKETS", "CacheMetrics", "TimedStore", "serve"]

#: Seconds; from a hit-path copy (10 us) to a store read that times out (60 s).
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

_COUNTERS: tuple[tuple[str, str, str], ...] = (
    # (metric name without _total, CacheStats field, help)
    ("embcache_hits", "hits", "Lookups that found a READY entry and pinned it."),
    ("embcache_loads_started", "loads_started", "Store reads started into the pool."),
    ("embcache_inserts", "inserts", "Fresh encoder outputs copied into the pool."),
    ("embcache_publishes_started", "publishes_started", "Writes of entries to the global store."),
    ("embcache_evictions", "evictions", "Entries evicted to make room."),
    ("embcache_evicted_bytes", "evicted_bytes", "Bytes of the entries evicted."),
    ("embcache_single_flight_joins", "single_flight_joins",
     "Lookups that joined a load or encode already in flight."),
    ("embcache_fences", "fences", "Store fences completed (quarantined ranges freed)."),
    ("embcache_publish_backlog_dropped", "publish_backlog_dropped",
     "Failed publishes dropped unretried: the oldest, beyond the backlog's bound."),
    ("embcache_publish_backlog_stale", "publish_backlog_stale",
     "Failed publishes not retried: evicted, removed or quarantined before the store returned."),
)  # fmt: skip
_COUNTERS_BY_LABEL: tuple[tuple[str, str, str, str], ...] = (
    # (metric name without _total, CacheStats dict field, label, help)
    ("embcache_misses", "misses_by_reason", "reason", "Lookups that found nothing usable."),
    ("embcache_fallbacks", "fallbacks_by_reason", "reason",
     "Items the caller had to encode although the cache was asked for them."),
    ("embcache_allocation_failures", "allocation_failures_by_reason", "reason",
     "Allocations refused (no contiguous space even after eviction, too big, ...)."),
)  # fmt: skip
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("embcache_capacity_bytes", "capacity_bytes", "Size of the pool."),
    ("embcache_allocated_bytes", "allocated_bytes", "Bytes of the pool held by entries."),
    ("embcache_free_bytes", "free_bytes", "Bytes of the pool not held by any entry."),
    ("embcache_largest_free_block_bytes", "largest_free_block",
     "The largest contiguous free range: the biggest item that fits without eviction."),
    ("embcache_fragmentation_ratio", "fragmentation",
     "1 - largest free block / free bytes: 0 when the free space is one range."),
    ("embcache_pinned_entries", "pinned_entries", "Entries held by at least one request."),
    ("embcache_pinned_bytes", "pinned_bytes", "Bytes of the pinned entries."),
    ("embcache_oldest_pin_age_seconds", "oldest_pin_age_s",
     "How long the longest-held entry has been pinned."),
    ("embcache_open_requests", "open_requests", "Requests opened and not yet closed."),
    ("embcache_publish_backlog", "publish_backlog",
     "Failed publishes waiting to be written when the store answers again."),
)  # fmt: skip


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidTypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidArgumentError(f"{what} must be a non-empty str, got {value!r}")
    return value


class CacheMetrics:
    """A Prometheus collector over the ``stats()`` of named caches, plus latency histograms.

    ``add(name, cache)`` watches a cache (``name`` is its ``cache`` label). Register the
    collector with a ``prometheus_client.CollectorRegistry`` (or the default ``REGISTRY``) and
    serve that (``serve``). Latencies may be observed under a name before its cache is added.
    The latency histograms keep at most ``MAX_LABEL_PAIRS`` distinct (cache, modality) pairs:
    one more raises ``InvalidArgumentError`` and records nothing, so no label set grows
    without bound. Thread-safe.
    """

    MAX_LABEL_PAIRS = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, EmbeddingCache] = {}
        self._pairs: set[tuple[str, str]] = set()  # (cache, modality) series of the histograms
        labels = ("cache", "modality")
        self._load = Histogram(
            "embcache_load_seconds",
            "Seconds from the start of a store read into the pool to its end, per item.",
            labels, registry=None, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self._insert = Histogram(
            "embcache_insert_seconds",
            "Seconds to insert fresh encoder outputs into the pool, per insert call.",
            labels, registry=None, buckets=LATENCY_BUCKETS,
        )  # fmt: skip

    def add(self, name: str, cache: EmbeddingCache) -> None:
        """Report ``cache.stats()`` under the label ``cache=name`` from now on. O(1)."""
        _check_name("name", name)
        if not isinstance(cache, EmbeddingCache):
            raise InvalidTypeError(f"cache must be an EmbeddingCache, got {type(cache).__name__}")
        with self._lock:
            if name in self._caches:
                raise InvalidArgumentError(
                    f"a cache named {name!r} is already watched: give each cache its own name"
                )
            self._caches[name] = cache

    @property
    def names(self) -> list[str]:
        """The names of the watched caches, in the order added. O(caches)."""
        with self._lock:
            return list(self._caches)

    def observe_load(self, cache: str, seconds: float, modality: str = "image") -> None:
        """Record one load's latency for cache ``cache``. O(buckets)."""
        seconds = _check_seconds(seconds)  # before .labels(), which adds a series
        self._load.labels(*self._pair(cache, modality)).observe(seconds)

    def observe_insert(self, cache: str, seconds: float, modality: str = "image") -> None:
        """Record one insert call's latency for cache ``cache``. O(buckets)."""
        seconds = _check_seconds(seconds)  # before .labels(), which adds a series
        self._insert.labels(*self._pair(cache, modality)).observe(seconds)

    def _pair(self, cache: str, modality: str) -> tuple[str, str]:
        """The checked label pair; a new one only while fewer than MAX_LABEL_PAIRS exist."""
        pair = (_check_name("cache", cache), _check_name("modality", modality))
        if pair in self._pairs:  # the common case: a known pair, no lock (pairs are only added)
            return pair
        with self._lock:
            if pair not in self._pairs:
                if len(self._pairs) >= self.MAX_LABEL_PAIRS:
                    raise InvalidArgumentError(
                        f"latency histograms already hold {self.MAX_LABEL_PAIRS} (cache, modality)"
                        f" label pairs; {pair} would be one more: use a fixed set of cache and"
                        " modality names"
                    )
                self._pairs.add(pair)
        return pair

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry then takes no snapshot at registration (see ``collect``)."""
        return ()

    def collect(self) -> Iterator[Metric]:
        """Every metric, read from one ``stats()`` per cache. O(entries of every cache)."""
        with self._lock:
            caches = list(self._caches.items())
        stats = {name: cache.stats() for name, cache in caches}
        yield from _counters(stats)
        yield from _gauges(stats)
        yield from self._load.collect()
        yield from self._insert.collect()


def _check_seconds(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidTypeError(f"seconds must be a number, got {type(seconds).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"seconds must be finite and >= 0, got {seconds}")
    return float(seconds)


def _counters(stats: Mapping[str, CacheStats]) -> Iterator[Metric]:
    for name, field, doc in _COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["cache"])
        for cache, s in stats.items():
            family.add_metric([cache], getattr(s, field))
        yield family
    for name, field, label, doc in _COUNTERS_BY_LABEL:
        family = CounterMetricFamily(name, doc, labels=["cache", label])
        for cache, s in stats.items():
            for value, count in sorted(getattr(s, field).items()):
                family.add_metric([cache, value], count)
        yield family
    for kind in ("loads", "publishes"):
        family = CounterMetricFamily(
            f"embcache_{kind}_ended", f"{kind.capitalize()} ended, by outcome.",
            labels=["cache", "outcome"],
        )  # fmt: skip
        for cache, s in stats.items():
            for outcome in TransferOutcome:
                family.add_metric(
                    [cache, outcome.name.lower()], getattr(s, f"{kind}_{outcome.name.lower()}")
                )
        yield family


def _gauges(stats: Mapping[str, CacheStats]) -> Iterator[Metric]:
    for name, field, doc in _GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["cache"])
        for cache, s in stats.items():
            family.add_metric([cache], getattr(s, field))
        yield family
    entries = GaugeMetricFamily("embcache_entries", "Entries by state.", labels=["cache", "state"])
    held = GaugeMetricFamily(
        "embcache_entry_bytes", "Bytes of the entries, by state.", labels=["cache", "state"]
    )
    for cache, s in stats.items():
        for state, count in sorted(s.entries_by_state.items()):
            entries.add_metric([cache, state], count)
            held.add_metric([cache, state], s.bytes_by_state.get(state, 0))
    yield entries
    yield held


class TimedStore:
    """A ``GlobalStore`` that forwards every call to ``inner`` and times its reads.

    Each ``get_into`` batch's wall time is recorded for each of its items as a load of cache
    ``cache`` in ``metrics`` (the items of one batch start and end together). Wrap the store
    before giving it to the cache: ``EmbeddingCache(n, store=TimedStore(store, metrics, name))``.
    Thread-safe.
    """

    def __init__(
        self, inner: GlobalStore, metrics: CacheMetrics, cache: str, modality: str = "image"
    ) -> None:
        self._inner = inner
        self._metrics = metrics
        self._cache = _check_name("cache", cache)
        self._modality = _check_name("modality", modality)

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._inner.register_buffer(buffer)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._inner.exists(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        started = time.perf_counter()
        codes = self._inner.get_into(keys, offsets, sizes)
        seconds = time.perf_counter() - started
        for _ in codes:
            self._metrics.observe_load(self._cache, seconds, self._modality)
        return codes

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        return self._inner.put_from(keys, offsets, sizes)

    def classify(self, code: int) -> TransferOutcome:
        return self._inner.classify(code)

    def fence(self) -> None:
        self._inner.fence()

    def close(self) -> None:
        self._inner.close()


def serve(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve ``registry`` over HTTP (any path) on a daemon thread; ``port=0`` picks a free port.

    The port is ``server.server_port``; stop with ``server.shutdown(); server.server_close()``.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
