"""The main job, ``python -m embcache demo``: a small encode worker under a realistic load.

A catalogue of synthetic images of mixed sizes; requests of a few images each, drawn from a
Zipf popularity; ``concurrency`` lanes send them at the same time through one
``EncodePipeline`` over a pool small enough that eviction matters, with ``TinyViT`` as the
encoder and, by default, no global tier (the pool is the whole cache: its size bounds the
memory the cache keeps), or a Mooncake global store behind it, of which a seeded fraction of
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
``metrics_port`` set, the cache's metrics (``embcache.tools.metrics``) are served on 127.0.0.1 for
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
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import torch
from tqdm import tqdm

from embcache.driver.cache import EmbeddingCache
from embcache.driver.global_store import GlobalStore, TransferOutcome
from embcache.pipeline import EncodePipeline
from embcache.tools.demo_report import (
    DemoConfig,
    DemoResult,
    PipelineTotals,
    Sample,
    leak_check,
    make_result,
    result_json,
    write_plot,
)
from embcache.tools.encoders import TinyViT, synthetic_image

if TYPE_CHECKING:  # embcache.tools.metrics needs the optional prometheus_client
    from embcache.tools.metrics import CacheMetrics

__all__ = [
    "DTYPES",
    "DemoConfig",
    "DemoResult",
    "FlakyStore",
    "Sample",
    "free_loopback_port",
    "result_json",
    "run_demo",
    "write_plot",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMAGE_SIZES = ((112, 112), (112, 224), (224, 224), (224, 336), (336, 224), (336, 336))
COLLECTIVE_TIMEOUT_S = 120.0


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
def _global_store(config: DemoConfig) -> Iterator[GlobalStore | None]:
    """The store the config asks for (None: no global tier); a master started here is stopped
    on the way out."""
    if config.store == "none":
        yield None
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
            rate = config.store_fault_rate
            flaky = None if store is None else FlakyStore(store, rate, config.seed)
            metrics = None if config.metrics_port is None else _serve_metrics(
                stack, config.metrics_port
            )  # fmt: skip
            timed = flaky if metrics is None or flaky is None else _timed(flaky, metrics)
            pool = int(config.pool_mib * (1 << 20)) // 256 * 256
            cache = (
                EmbeddingCache(pool, store=timed, pin_memory=False)
                if config.policy is None
                else EmbeddingCache(pool, store=timed, pin_memory=False, policy=config.policy)
            )
            stack.callback(cache.close)
            if metrics is not None:
                metrics.add("demo", cache)
            return _run(config, cache, flaky, progress, metrics)
    finally:
        torch.set_num_threads(threads)


def _timed(store: GlobalStore, metrics: CacheMetrics) -> GlobalStore:
    from embcache.tools.metrics import TimedStore

    return TimedStore(store, metrics, "demo")


def _insert_observer(metrics: CacheMetrics) -> Callable[[int, float], None]:
    """Feeds each pipeline insert's latency to the ``demo`` cache's insert histogram."""
    return lambda _items, seconds: metrics.observe_insert("demo", seconds)


def _serve_metrics(stack: contextlib.ExitStack, port: int) -> CacheMetrics:
    """Metrics served on 127.0.0.1:``port`` until ``stack`` closes."""
    from prometheus_client import CollectorRegistry

    from embcache.tools.metrics import CacheMetrics, serve

    metrics = CacheMetrics()
    registry = CollectorRegistry()
    registry.register(metrics)
    server = serve(registry, port)
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return metrics


def _run(
    config: DemoConfig,
    cache: EmbeddingCache,
    store: FlakyStore | None,
    out: TextIO | None,
    metrics: CacheMetrics | None = None,
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
                on_insert=None if metrics is None else _insert_observer(metrics),
            )
            for lane in range(config.concurrency)
        ]

        def pipeline_stats() -> PipelineTotals:
            return PipelineTotals.of([p.stats() for p in pipelines])

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
    return make_result(
        config, cache.stats(), pipeline_stats(), progress.latencies, seconds,
        0 if store is None else store.injected,
        errors, leak_check(cache), progress.mismatches if config.verify else None,
        progress.timeline,
    )  # fmt: skip


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
