"""The main job, ``python -m embcache demo``: a small encode worker under a realistic load.

A catalogue of synthetic images of mixed sizes; requests of a few images each, drawn from a
Zipf popularity; ``concurrency`` lanes send them at the same time through one
``EncodePipeline`` over a pool small enough that eviction matters, with ``TinyViT`` as the
encoder and the in-process or a Mooncake global store behind it. A seeded fraction of store
reads fails on purpose, so per-item fallbacks show. At the end the cache is closed and checked
for leaks: no pin, no load in flight, no open request, accounting exact, invariants hold.

Definitions used in the summary (every number is per image looked up, unless it says so):
local hit: in the pool at lookup. Global hit: read from the global store (a load that ended
OK); a request that joined a transfer another request started counts as a single-flight join
instead. Encoded: given to the encoder (an image repeated in one request counts once).
Encodes saved: images looked up minus images encoded (encoder calls are the batches the
encoder ran). Fallback: an item encoded for a reason other than a plain miss (a failed,
timed-out or quarantined load, no space, ...). Fragmentation: 1 - largest free range / free
bytes; 0 when the free space is one range, near 1 when it is scattered in small holes, so an
item may not fit (and entries are evicted) although enough bytes are free in total.

A progress bar (tqdm) goes to the progress stream only when it is a terminal. With
``metrics_port`` set, the cache's metrics (``embcache.metrics``) are served on 127.0.0.1 for
the length of the run (``python -m embcache demo --metrics-port 0`` picks a free port and
prints it); store reads are timed into ``embcache_load_seconds``.

With ``tp > 1``, ranks 1.. run in spawned processes on loopback gloo; each lane has its own
group, so lanes stay independent and each group sees its calls in the same order on every
rank. Torch runs single-threaded per lane (the lanes are the parallelism); the previous thread
count is restored afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import math
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from tqdm import tqdm

from embcache.cache import CacheStats, EmbeddingCache
from embcache.encoders import TinyViT, synthetic_image
from embcache.errors import InvariantError
from embcache.pipeline import EncodePipeline
from embcache.store.base import GlobalStore, TransferOutcome

if TYPE_CHECKING:  # embcache.metrics needs the optional prometheus_client
    from embcache.metrics import CacheMetrics

__all__ = [
    "DTYPES",
    "DemoConfig",
    "DemoResult",
    "FlakyStore",
    "result_json",
    "run_demo",
    "write_plot",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMAGE_SIZES = ((112, 112), (112, 224), (224, 224), (224, 336), (336, 224), (336, 336))
COLLECTIVE_TIMEOUT_S = 120.0


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
    store: str = "inprocess"  # or "mooncake"
    master: str | None = None  # a running mooncake_master; None: start one on loopback
    metadata_server: str | None = None
    segment_mib: int = 256  # memory this worker lends to the Mooncake store
    store_fault_rate: float = 0.02
    prefetch_timeout: float = 5.0
    seed: int = 0
    verify: bool = False
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

        store = c.store if c.store_fault_rate == 0 else (
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


# ---------------------------------------------------------------------------- the store
class FlakyStore:
    """A ``GlobalStore`` that fails a seeded fraction of reads and forwards everything else.

    A failed read returns ``FLAKY`` without touching the pool, which ``classify`` calls
    FAILED (nothing in flight), so the cache frees the range and the item falls back.
    """

    FLAKY = -30001

    def __init__(self, inner: GlobalStore, rate: float, seed: int) -> None:
        self._inner = inner
        self._rate = rate
        self._rng = random.Random(f"embcache-demo-faults-{seed}")
        self._lock = threading.Lock()
        self.injected = 0

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._inner.register_buffer(buffer)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._inner.exists(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        with self._lock:
            failing = {i for i in range(len(keys)) if self._rng.random() < self._rate}
            self.injected += len(failing)
        keep = [i for i in range(len(keys)) if i not in failing]
        codes = [self.FLAKY] * len(keys)
        if keep:
            got = self._inner.get_into(
                [keys[i] for i in keep], [offsets[i] for i in keep], [sizes[i] for i in keep]
            )
            for i, code in zip(keep, got, strict=True):
                codes[i] = code
        return codes

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        return self._inner.put_from(keys, offsets, sizes)

    def classify(self, code: int) -> TransferOutcome:
        return TransferOutcome.FAILED if code == self.FLAKY else self._inner.classify(code)

    def fence(self) -> None:
        self._inner.fence()

    def close(self) -> None:
        self._inner.close()


@contextlib.contextmanager
def _global_store(config: DemoConfig) -> Iterator[GlobalStore]:
    """The store the config asks for; a master started here is stopped on the way out."""
    if config.store == "inprocess":
        from embcache.store.inprocess import InProcessStore

        with contextlib.closing(InProcessStore()) as embedded:
            yield embedded
        return
    from embcache.store.mooncake import MooncakeStore
    from embcache.store.mooncake_master import MooncakeMaster

    with contextlib.ExitStack() as stack:
        prefix = f"embcache-demo/{config.dtype}-{config.hidden}-seed{config.seed}/"
        kwargs: dict[str, Any] = {
            "metadata_server": config.metadata_server,
            "global_segment_size": config.segment_mib << 20,
            "key_prefix": prefix,
        }
        if config.master is None:
            master = stack.enter_context(MooncakeMaster())
            kwargs.update(master.store_kwargs())
            for name, value in MooncakeMaster.CLIENT_ENVIRONMENT.items():
                os.environ.setdefault(name, value)  # read by Mooncake at each client setup
            kwargs["key_prefix"] = prefix + uuid.uuid4().hex[:8] + "/"
        else:
            kwargs["master_address"] = config.master
        mooncake = stack.enter_context(MooncakeStore(**kwargs))
        mooncake.connect()
        yield mooncake


# ---------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Workload:
    """The catalogue (seed, height, width per image) and each request's image indices."""

    catalogue: list[tuple[int, int, int]]
    requests: list[list[int]]

    @classmethod
    def of(cls, config: DemoConfig) -> Workload:
        """Deterministic in ``config.seed``: every TP rank builds the same one."""
        rng = random.Random(config.seed)
        catalogue = [
            (config.seed * 1_000_003 + i, *rng.choice(IMAGE_SIZES)) for i in range(config.catalogue)
        ]
        weights = list(
            itertools.accumulate(1.0 / (i + 1) ** config.zipf for i in range(config.catalogue))
        )
        requests = [
            rng.choices(range(config.catalogue), cum_weights=weights,
                        k=rng.randint(1, config.images_per_request))
            for _ in range(config.requests)
        ]
        return cls(catalogue, requests)

    def images(self, request: int) -> list[torch.Tensor]:
        return [synthetic_image(*self.catalogue[i]) for i in self.requests[request]]


def _encoder(config: DemoConfig) -> TinyViT:
    return TinyViT(hidden_size=config.hidden, dtype=DTYPES[config.dtype], seed=config.seed)


def _run_lane(
    pipeline: EncodePipeline,
    encoder: TinyViT,
    workload: Workload,
    lane: int,
    lanes: int,
    on_done: Callable[[float, bool], None],
    errors: list[str],
    verify: bool,
    stop: threading.Event,
) -> None:
    """Send requests ``lane, lane + lanes, ...`` one after another, until ``stop`` is set."""
    for index in range(lane, len(workload.requests), lanes):
        if stop.is_set():
            return
        images = workload.images(index)
        started = time.perf_counter()
        try:
            items = [encoder.item(image) for image in images]
            embeddings = pipeline.encode(f"req-{index}", items, images)
        except Exception as exc:  # recorded and reported: the demo keeps going
            errors.append(f"request {index}: {type(exc).__name__}: {exc}")
            continue
        latency = time.perf_counter() - started
        ok = not verify or torch.allclose(
            embeddings.float(), torch.cat(encoder(images)).float(), rtol=0.02, atol=0.02
        )
        on_done(latency, ok)


# ---------------------------------------------------------------------------- running
class _Progress:
    """Counts finished requests and samples the timeline every 0.1 s (no cache lock held).

    The bar (tqdm) is drawn only when ``out`` is a terminal: files and CI logs get none.
    """

    def __init__(
        self, total: int, cache: EmbeddingCache, pipeline_stats: Callable[[], Any],
        out: TextIO | None,
    ) -> None:  # fmt: skip
        self.cache = cache
        self.pipeline_stats = pipeline_stats
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.mismatches = 0
        self.timeline: list[Sample] = []
        self.started = time.perf_counter()
        self._bar = tqdm(
            total=total, unit="req", file=out, dynamic_ncols=True, mininterval=0.1,
            disable=out is None or not out.isatty(),
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="embcache-demo-progress")

    def done(self, latency: float, ok: bool) -> None:
        with self.lock:
            self.latencies.append(latency)
            self.mismatches += not ok

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._bar.close()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def _sample(self) -> None:
        cache, pipe = self.cache.stats(), self.pipeline_stats()
        with self.lock:
            finished = len(self.latencies)
        images = max(pipe.items, 1)
        sample = Sample(
            seconds=time.perf_counter() - self.started,
            requests=finished,
            local_hit_ratio=pipe.local_hits / images,
            global_hit_ratio=cache.loads_ok / images,
            occupancy=cache.allocated_bytes / cache.capacity_bytes,
            fragmentation=cache.fragmentation,
        )
        self.timeline.append(sample)
        self._bar.set_postfix_str(
            f"local hits {100 * sample.local_hit_ratio:.0f}%, pool {100 * sample.occupancy:.0f}%",
            refresh=False,
        )
        self._bar.update(finished - self._bar.n)


def run_demo(config: DemoConfig, progress: TextIO | None = None) -> DemoResult:
    """Run the demo; the progress bar goes to ``progress`` when it is a terminal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(_global_store(config))
            flaky = FlakyStore(store, config.store_fault_rate, config.seed)
            metrics = None if config.metrics_port is None else _serve_metrics(
                stack, config.metrics_port
            )  # fmt: skip
            timed: GlobalStore = flaky if metrics is None else _timed(flaky, metrics)
            pool = int(config.pool_mib * (1 << 20)) // 256 * 256
            cache = EmbeddingCache(pool, store=timed, pin_memory=False)
            stack.callback(cache.close)
            if metrics is not None:
                metrics.add("demo", cache)
            return _run(config, cache, flaky, progress)
    finally:
        torch.set_num_threads(threads)


def _timed(store: GlobalStore, metrics: CacheMetrics) -> GlobalStore:
    from embcache.metrics import TimedStore

    return TimedStore(store, metrics, "demo")


def _serve_metrics(stack: contextlib.ExitStack, port: int) -> CacheMetrics:
    """Metrics served on 127.0.0.1:``port`` until ``stack`` closes."""
    from prometheus_client import CollectorRegistry

    from embcache.metrics import CacheMetrics, serve

    metrics = CacheMetrics()
    registry = CollectorRegistry()
    registry.register(metrics)
    server = serve(registry, port)
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return metrics


def _run(
    config: DemoConfig, cache: EmbeddingCache, store: FlakyStore, out: TextIO | None
) -> DemoResult:
    workload = Workload.of(config)
    encoder = _encoder(config)
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        groups = stack.enter_context(_tensor_parallel(config)) if config.tp > 1 else None
        pipelines = [
            EncodePipeline(
                cache,
                encoder,
                tp_group=None if groups is None else groups[lane],
                prefetch_timeout=config.prefetch_timeout,
                collective_timeout=None if groups is None else COLLECTIVE_TIMEOUT_S,
            )
            for lane in range(config.concurrency)
        ]

        def pipeline_stats() -> _Totals:
            return _Totals.of([p.stats() for p in pipelines])

        progress = stack.enter_context(
            _Progress(config.requests, cache, pipeline_stats, out)
        )
        stop = threading.Event()
        lanes = [
            threading.Thread(
                target=_run_lane,
                args=(p, encoder, workload, lane, config.concurrency, progress.done, errors,
                      config.verify, stop),
                name=f"embcache-demo-lane-{lane}",
            )
            for lane, p in enumerate(pipelines)
        ]
        try:
            for lane in lanes:
                lane.start()
            for lane in lanes:
                lane.join()
        finally:  # interrupted (SIGTERM, Ctrl-C): lanes end after their current request
            stop.set()
            for lane in lanes:
                if lane.is_alive():
                    lane.join()
    seconds = progress.timeline[-1].seconds
    cache.close()  # waits for every load and publish still in flight
    return _result(
        config, cache.stats(), pipeline_stats(), progress, seconds, store, errors,
        _leak_check(cache),
    )


@dataclass(frozen=True)
class _Totals:
    """Pipeline counters summed over the lanes."""

    items: int
    local_hits: int
    waited: int
    encoded: int
    encoder_calls: int
    fallbacks_by_reason: dict[str, int]

    @classmethod
    def of(cls, stats: Sequence[Any]) -> _Totals:
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


def _result(
    config: DemoConfig,
    s: CacheStats,
    totals: _Totals,
    progress: _Progress,
    seconds: float,
    store: FlakyStore,
    errors: list[str],
    leak_report: list[str],
) -> DemoResult:
    reasons = dict(totals.fallbacks_by_reason)
    misses = reasons.pop("not_found", 0)
    latencies = sorted(progress.latencies)
    return DemoResult(
        config=config,
        requests=len(latencies),
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
        injected_store_faults=store.injected,
        p50_ms=1000 * _percentile(latencies, 0.50),
        p99_ms=1000 * _percentile(latencies, 0.99),
        errors=errors,
        leak_report=leak_report,
        verify_mismatches=progress.mismatches if config.verify else None,
        timeline=progress.timeline,
    )


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _leak_check(cache: EmbeddingCache) -> list[str]:
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


# ---------------------------------------------------------------------------- TP ranks
@contextlib.contextmanager
def _tensor_parallel(config: DemoConfig) -> Iterator[list[Any]]:
    """Rank 0 here, ranks 1.. in spawned processes; one gloo group per lane."""
    import torch.distributed as dist
    from torch.multiprocessing.spawn import start_processes

    port = free_loopback_port()
    ranks = start_processes(  # type: ignore[no-untyped-call]
        _follower, args=(config, port), nprocs=config.tp - 1, join=False, start_method="spawn"
    )
    try:
        groups = _join_group(0, config, port)
        yield groups
        dist.barrier()
        dist.destroy_process_group()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not ranks.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel ranks did not finish")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for process in ranks.processes:
            if process.is_alive():
                process.kill()


def _join_group(rank: int, config: DemoConfig, port: int) -> list[Any]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=config.tp,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return [dist.new_group(backend="gloo") for _ in range(config.concurrency)]


def _follower(index: int, config: DemoConfig, port: int) -> None:
    """Rank ``index + 1``: the same requests, lane by lane, with no cache."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    groups = _join_group(index + 1, config, port)
    workload = Workload.of(config)
    encoder = _encoder(config)
    errors: list[str] = []

    def done(_latency: float, ok: bool) -> None:
        if not ok:
            errors.append("a response differed from a fresh encode")

    lanes = [
        threading.Thread(
            target=_run_lane,
            args=(
                EncodePipeline(None, encoder, tp_group=groups[lane],
                               collective_timeout=COLLECTIVE_TIMEOUT_S),
                encoder, workload, lane, config.concurrency, done, errors, config.verify,
                threading.Event(),
            ),
        )
        for lane in range(config.concurrency)
    ]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    dist.barrier()
    dist.destroy_process_group()
    if errors:
        raise RuntimeError(f"rank {index + 1}: {len(errors)} failed requests: {errors[0]}")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ---------------------------------------------------------------------------- the plot
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
