"""The demo's knobs and what a run measured: result, summary and JSON, leak check, plot.

``make_result`` turns the cache's ``stats()``, the pipelines' counters and the request latencies
into a ``DemoResult``; ``summary()`` is the human-readable report and ``to_json()`` the
``--json`` object (the same names in both); ``leak_check`` lists what a run left behind;
``write_plot`` draws the timeline with matplotlib (the ``plot`` extra). Definitions of the
numbers: ``embcache.tools.demo``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embcache.driver.cache import CacheStats, EmbeddingCache
from embcache.errors import InvariantError

__all__ = [
    "DemoConfig",
    "DemoResult",
    "PipelineTotals",
    "Sample",
    "leak_check",
    "make_result",
    "result_json",
    "write_plot",
]


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo; the defaults finish in seconds on two CPU cores."""

    requests: int = 400
    catalogue: int = 150
    images_per_request: int = 4  # each request has 1..this many images
    zipf: float = 1.1
    concurrency: int = 4
    pool_mib: float = 8.0
    hidden: int = 1024
    dtype: str = "bf16"
    tp: int = 1
    store: str = "none"  # no global tier; or "mooncake"
    master: str | None = None  # a running mooncake_master; None: start one on loopback
    metadata_server: str | None = None
    segment_mib: int = 256  # memory this worker lends to the Mooncake store
    store_fault_rate: float = 0.02
    prefetch_timeout: float = 5.0
    seed: int = 0
    verify: bool = False
    policy: str | None = None  # the cache's eviction policy; None: EmbeddingCache's default
    metrics_port: int | None = None  # serve Prometheus metrics here (0: a free port)


@dataclass(frozen=True)
class Sample:
    """One point of the timeline the plot draws."""

    seconds: float
    requests: int
    local_hit_ratio: float
    global_hit_ratio: float
    occupancy: float
    fragmentation: float


@dataclass
class DemoResult:
    """What a run measured; ``to_json`` is the ``--json`` output."""

    config: DemoConfig
    requests: int
    images: int
    seconds: float
    local_hits: int
    waited: int
    global_hits: int
    single_flight_joins: int
    encoded: int
    encoder_batches: int
    misses: int
    fallbacks_by_reason: dict[str, int]
    evictions: int
    evicted_bytes: int
    pool_bytes: int
    allocated_bytes: int
    entries: int
    fragmentation: float
    loads: dict[str, int]
    publishes: dict[str, int]
    injected_store_faults: int
    p50_ms: float
    p99_ms: float
    errors: list[str]
    leak_report: list[str]
    verify_mismatches: int | None
    build: str  # the core's build that ran: "compiled" or "pure" (CacheStats.build)
    timeline: list[Sample] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def encodes_saved(self) -> int:
        """Images looked up that were not given to the encoder."""
        return self.images - self.encoded

    @property
    def fallbacks(self) -> int:
        return sum(self.fallbacks_by_reason.values())

    @property
    def leaks(self) -> int:
        return len(self.leak_report)

    def to_json(self) -> dict[str, Any]:
        """One JSON object: every counter, the ratios, latency percentiles, the leak check."""
        images = max(self.images, 1)
        return {
            "requests": self.requests,
            "images": self.images,
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.requests_per_s, 2),
            "local_hits": self.local_hits,
            "waited": self.waited,
            "global_hits": self.global_hits,
            "single_flight_joins": self.single_flight_joins,
            "local_hit_ratio": round(self.local_hits / images, 4),
            "global_hit_ratio": round(self.global_hits / images, 4),
            "encoded": self.encoded,
            "encoder_batches": self.encoder_batches,
            "encodes_saved": self.encodes_saved,
            "misses": self.misses,
            "fallbacks": self.fallbacks,
            "fallbacks_by_reason": dict(sorted(self.fallbacks_by_reason.items())),
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
            "pool_bytes": self.pool_bytes,
            "pool_occupancy": round(self.allocated_bytes / self.pool_bytes, 4),
            "fragmentation": round(self.fragmentation, 4),
            "entries": self.entries,
            "loads": self.loads,
            "publishes": self.publishes,
            "injected_store_faults": self.injected_store_faults,
            "p50_ms": round(self.p50_ms, 2),
            "p99_ms": round(self.p99_ms, 2),
            "errors": len(self.errors),
            "error_samples": self.errors[:5],
            "leaks": self.leaks,
            "leak_report": self.leak_report,
            "verify_mismatches": self.verify_mismatches,
            "build": self.build,
            "config": asdict(self.config),
        }

    def summary(self) -> str:
        """The human-readable report."""
        c = self.config
        images = max(self.images, 1)

        def pct(n: int) -> str:
            return f"{100 * n / images:.1f}%"

        def mib(n: int) -> str:
            return f"{n / (1 << 20):.1f} MiB"

        store = c.store if c.store_fault_rate == 0 or c.store == "none" else (
            f"{c.store} ({100 * c.store_fault_rate:g}% of store reads fail on purpose)"
        )
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.fallbacks_by_reason.items()))
        leak = (
            "OK: no pins, no loads in flight, no open requests, accounting exact, invariants hold"
            if not self.leak_report
            else "FAILED: " + "; ".join(self.leak_report)
        )
        lines = [
            f"embcache demo: {self.requests} requests of 1..{c.images_per_request} images "
            f"(catalogue {c.catalogue}, zipf {c.zipf:g}), {c.concurrency} concurrent, TP {c.tp}",
            f"  pool {mib(self.pool_bytes)}, {c.dtype} embeddings x {c.hidden}, store {store}",
            f"  core build {self.build}",
            "",
            f"throughput        {self.requests_per_s:.1f} requests/s ({self.seconds:.2f} s)",
            f"latency           p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms",
            f"images looked up  {self.images}",
            f"  local hits      {self.local_hits} ({pct(self.local_hits)})",
            f"  global hits     {self.global_hits} ({pct(self.global_hits)}) read from the store",
            f"  joins           {self.single_flight_joins} single-flight joins of a transfer "
            "in flight",
            f"  encoded         {self.encoded} images in {self.encoder_batches} encoder calls; "
            f"{self.encodes_saved} encodes saved ({pct(self.encodes_saved)})",
            f"misses            {self.misses} not found",
            f"fallbacks         {self.fallbacks}" + (f": {reasons}" if reasons else ""),
            f"evictions         {self.evictions} entries ({mib(self.evicted_bytes)})",
            f"pool              {self.entries} entries, occupancy "
            f"{100 * self.allocated_bytes / self.pool_bytes:.1f}%, "
            f"fragmentation {100 * self.fragmentation:.1f}%",
            f"store             loads {_fmt(self.loads)}; publishes {_fmt(self.publishes)}",
        ]
        if self.verify_mismatches is not None:
            lines.append(f"verify            {self.verify_mismatches} responses differ from "
                         "a fresh encode")
        if self.errors:
            lines.append(f"errors            {len(self.errors)}: {self.errors[0]}")
        lines.append(f"leak check        {leak}")
        return "\n".join(lines)


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items())


@dataclass(frozen=True)
class PipelineTotals:
    """Pipeline counters summed over the lanes."""

    items: int
    local_hits: int
    waited: int
    encoded: int
    encoder_calls: int
    fallbacks_by_reason: dict[str, int]

    @classmethod
    def of(cls, stats: Sequence[Any]) -> PipelineTotals:
        reasons: dict[str, int] = {}
        for s in stats:
            for k, v in s.fallbacks_by_reason.items():
                reasons[k] = reasons.get(k, 0) + v
        return cls(
            items=sum(s.items for s in stats),
            local_hits=sum(s.local_hits for s in stats),
            waited=sum(s.waited for s in stats),
            encoded=sum(s.encoded for s in stats),
            encoder_calls=sum(s.encoder_calls for s in stats),
            fallbacks_by_reason=reasons,
        )


def make_result(
    config: DemoConfig,
    s: CacheStats,
    totals: PipelineTotals,
    latencies: Sequence[float],
    seconds: float,
    injected_store_faults: int,
    errors: list[str],
    leak_report: list[str],
    verify_mismatches: int | None,
    timeline: list[Sample],
) -> DemoResult:
    """The result of a run from what it counted (``latencies``: seconds per request)."""
    reasons = dict(totals.fallbacks_by_reason)
    misses = reasons.pop("not_found", 0)
    ordered = sorted(latencies)
    return DemoResult(
        config=config,
        requests=len(ordered),
        images=totals.items,
        seconds=seconds,
        local_hits=totals.local_hits,
        waited=totals.waited,
        global_hits=s.loads_ok,
        single_flight_joins=s.single_flight_joins,
        encoded=totals.encoded,
        encoder_batches=totals.encoder_calls,
        misses=misses,
        fallbacks_by_reason=reasons,
        evictions=s.evictions,
        evicted_bytes=s.evicted_bytes,
        pool_bytes=s.capacity_bytes,
        allocated_bytes=s.allocated_bytes,
        entries=s.entries,
        fragmentation=s.fragmentation,
        loads={
            "started": s.loads_started,
            "ok": s.loads_ok,
            "failed": s.loads_failed,
            "unknown": s.loads_unknown,
        },
        publishes={
            "started": s.publishes_started,
            "ok": s.publishes_ok,
            "failed": s.publishes_failed,
            "unknown": s.publishes_unknown,
        },
        injected_store_faults=injected_store_faults,
        p50_ms=1000 * _percentile(ordered, 0.50),
        p99_ms=1000 * _percentile(ordered, 0.99),
        errors=errors,
        leak_report=leak_report,
        verify_mismatches=verify_mismatches,
        build=s.build,
        timeline=timeline,
    )


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def leak_check(cache: EmbeddingCache) -> list[str]:
    """Everything left behind after the last request: empty when nothing leaked."""
    problems: list[str] = []
    try:
        cache.check_invariants()
    except InvariantError as exc:
        problems.append(str(exc))
    s = cache.stats()
    if s.pinned_entries:
        problems.append(f"{s.pinned_entries} entries still pinned ({s.pinned_bytes} bytes)")
    if s.entries_by_state.get("LOADING", 0):
        problems.append(f"{s.entries_by_state['LOADING']} entries still LOADING")
    if s.open_requests:
        problems.append(f"{s.open_requests} requests still open")
    if s.allocated_bytes != sum(s.bytes_by_state.values()):
        problems.append(
            f"allocated {s.allocated_bytes} bytes but entries hold {sum(s.bytes_by_state.values())}"
        )
    if s.allocated_bytes + s.free_bytes != s.capacity_bytes:
        problems.append("allocated + free bytes differ from the capacity")
    if s.loads_started != s.loads_ok + s.loads_failed + s.loads_unknown:
        problems.append(f"{s.loads_started} loads started but not all ended")
    if s.publishes_started != s.publishes_ok + s.publishes_failed + s.publishes_unknown:
        problems.append(f"{s.publishes_started} publishes started but not all ended")
    return problems


_LEGEND = {
    "local_hit_ratio": "local hits: found in this worker's pool",
    "global_hit_ratio": "global hits: read from the global store into the pool",
    "occupancy": "occupancy: bytes held by entries / pool size",
    "fragmentation": "fragmentation: 1 - largest free range / free bytes\n"
    "(high: the free space is scattered in small holes, so an item\n"
    "may not fit and entries are evicted although bytes are free)",
}


def write_plot(timeline: Sequence[Sample], path: Path) -> None:
    """Draw hit ratios (top) and pool occupancy and fragmentation (bottom) over time as PNG.

    Needs matplotlib (``pip install 'embcache[plot]'``); raises ``ImportError`` saying so.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import PercentFormatter
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib ({exc}): pip install 'embcache[plot]'") from exc
    seconds = [s.seconds for s in timeline]
    figure = Figure(figsize=(12, 6.5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    panels = (
        (top, "Hit ratio, cumulative", "% of images looked up",
         ("local_hit_ratio", "global_hit_ratio")),
        (bottom, "Pool", "percent (see the legend)", ("occupancy", "fragmentation")),
    )  # fmt: skip
    for axes, title, unit, fields in panels:
        for name in fields:
            axes.plot(seconds, [100 * getattr(s, name) for s in timeline], label=_LEGEND[name])
        axes.set_title(title)
        axes.set_ylabel(unit)
        axes.set_ylim(-2, 102)
        axes.yaxis.set_major_formatter(PercentFormatter())
        axes.grid(alpha=0.3)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    bottom.set_xlabel("time since the first request (s)")
    figure.suptitle("embcache demo")
    figure.savefig(path, format="png", dpi=100)


def result_json(result: DemoResult) -> str:
    """The ``--json`` line."""
    return json.dumps(result.to_json(), sort_keys=False)
