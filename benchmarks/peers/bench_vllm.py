"""The vLLM connector's costs, each measured side by side with its baseline in one run.

Side by side with vLLM 0.33.0's own ``ECCPUConnector`` (run from its wheel:
``tests.support.vllm_cpu_connector`` says exactly what is replaced: its CUDA copy kernel
``swap_blocks_batch`` by a CPU copy, its streams and timing events by no-ops, on the worker
side only; its scheduler side runs as shipped). Both connectors, each with 126 MB (our
``pool_bytes``, its ``ec_cpu_bytes``) and no other memory, go through vLLM's engine-step call
order (``tests.support.vllm_engine``: encode allocations before loads, ``request_finished``
before the step's acks) on the issue's workload: 300 requests of 1-4 images, Zipf(1) over 500
images of 64-2048 rows x 1024 fp16, two ranks. Rows:

- the scheduler's CPU time per image, every scheduler-role call (``ensure_cache_available``,
  ``has_cache_item``, ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``request_finished``) of the run replayed alone on a fresh
  scheduler (as in vLLM, whose ranks are other processes; thread CPU time, less the replay
  loop's own, measured with a scheduler that does nothing; the median of alternating
  repetitions). Target: ours <= 1.0x ECCPUConnector's. The same in callgrind instructions with
  ``--callgrind`` (``benchmarks/peers/vllm_engine_probe.py``).
- what vLLM was told and got: the images requested, errors the engine met (target 0), items
  declared present, declared items a rank did not have (vLLM's "Encoder cache miss", which
  kills the engine; target 0), items loaded;
- images vLLM did not encode, against an ideal LRU of the same bytes (no fragmentation, no
  pins; target: within 0.5 point), and with ``policy="adaptive"`` (target: more);
- the worker's load rate in the run (``start_load_caches``, both ranks).

Also: ``has_cache_item`` for an item the current request holds against a plain ``key in dict``
(target 2x; ns, and instructions with ``--callgrind``) and against the floor of any connector
method vLLM calls: ``obj.has(key)`` where ``has`` is an instance attribute bound to a dict's
``__contains__`` (one C call, no Python frame; ours is exactly that), and ``start_load_caches``
copying 4 MB and 64 MB float16 items out of the shared pool into new tensors in ``encoder_cache``
against a raw ``view.to(device, copy=True)`` of the same bytes (items cycle through 128 MB so the
bytes come from memory; one intra-op thread; glibc keeps freed blocks under 32 MB; chunks
alternate; GB/s is the median; target 0.9 of raw). With CUDA the copies go to the GPU
(synchronized); this machine has none, so the CUDA path is not measured here.

The pool sweep (issue 56): the issue's workload (300 requests of 1-4 images, Zipf(1) over 500
images of 64-2048 rows x 1024 fp16; 2 requests admitted a step, each running 2 steps) with
pools of 2x, 1x, 0.5x and 0.25x its working set (the bytes of the distinct images it requests),
ours with the connector's default policy. Rows per pool: the scheduler CPU time per image
against ECCPUConnector's (as above; target <= 1.0x), and where it goes, per vLLM method (each
call timed alone); images not encoded against an ideal LRU of the same bytes (target: at least
it), and ours with ``lru`` and ECCPUConnector's for reference; items declared that a rank then
lacked (target 0, and the run raises if ours declares one). ``--pools``: only these rows (with
``--tiny``, their smoke size). ``--callgrind-pools``: the same pools in scheduler instructions
per image, ours against ECCPUConnector's (also part of ``--callgrind``).

The machine may be shared with other jobs: read the ratios, not the absolute numbers.
Run from the repository root: python -m benchmarks.peers.bench_vllm [--quick | --tiny | --callgrind
| --callgrind-pools] [--pools] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import make_row, print_rows, skipped_row
from tests.support import vllm_wheel
from tests.support.callgrind import dump_totals
from tests.support.rows import json_row
from tests.support.vllm_wheel import FakeRequest, vllm_config

MB = 1 << 20
SIZES = (4 * MB, 64 * MB)
WIDTH = 1024
TARGET = 0.9
POOL_BYTES = 128 * MB
VALGRIND = ("valgrind", "--tool=callgrind", "--collect-atstart=no")
SCHEDULER_CHUNKS = {True: (10, 20), False: (40, 50)}  # (chunks, requests a chunk), by --quick


WIDTH_SBS = 1024  # the side-by-side workload's embedding width (fp16)
SBS_POOL = 126 * MB  # every cache's memory in the side-by-side run
WORKLOAD = {"requests": 300, "images": 500}  # 1-4 images a request, Zipf(1), 64-2048 rows
# --tiny (the test's smoke run): 40 requests over 16 images in 4 MB, one replay each; two
# chunks of three for has_cache_item; 256 KiB items cycling through 1 MB for the worker's copy
TINY = {"requests": 40, "images": 16, "reps": 1, "pool": 4 * MB, "chunks": (2, 3)}
TINY_COPY = {"sizes": (256 * 1024,), "pool": 1 * MB}
# The pool sweep (issue 56): 300 requests over 500 images, 2 admitted a step, each running 2
# steps; pools of 2x, 1x, 0.5x and 0.25x the trace's working set (its distinct images' bytes)
PRESSURE = {"requests": 300, "images": 500, "admit": 2, "steps": 2}
POOLS = (2.0, 1.0, 0.5, 0.25)
EPS = 1e-9  # two shares of one count computed two ways (1 - encoded/images, hits/total)
TINY_PRESSURE = {"requests": 48, "images": 24}  # --tiny: the same shape, small


def workload(requests: int, images: int) -> list[FakeRequest]:
    """The side-by-side workload (``tests.support.vllm_engine.workload``)."""
    from tests.support import vllm_engine

    return vllm_engine.workload(requests, images)


def contender(
    name: str, pool_bytes: int, policy: str = "lru"
) -> tuple[Any, list[Any], contextlib.AbstractContextManager[None]]:
    """``tests.support.vllm_cpu_connector.contender`` at the side-by-side width: ``embcache``
    or ``eccpu``, its workers, and the context that runs and shuts them down."""
    from tests.support import vllm_cpu_connector

    return vllm_cpu_connector.contender(name, pool_bytes, policy, WIDTH_SBS)


def engine(scheduler: Any, workers: list[Any], **kwargs: Any) -> Any:
    """``tests.support.vllm_engine.Engine`` over the side-by-side width."""
    from tests.support import vllm_engine

    return vllm_engine.Engine(scheduler, workers, WIDTH_SBS, **kwargs)


def _median_ns(fn: Callable[[int], None], per_call: int, chunks: int, reps: int) -> list[float]:
    """ns per item of ``fn(rep)`` over ``chunks`` chunks of ``reps`` calls."""
    out = []
    for _ in range(chunks):
        start = time.perf_counter_ns()
        for rep in range(reps):
            fn(rep)
        out.append((time.perf_counter_ns() - start) / (reps * per_call))
    return out


class NullScheduler:
    """A scheduler-role connector that does nothing: what a replay costs by itself."""

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        return True

    def has_cache_item(self, identifier: str) -> bool:
        return False

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def request_finished(self, request: Any) -> tuple[bool, None]:
        return False, None


def _replay_cpu_ns(scheduler: Any, script: list[Any], check: bool = True) -> int:
    from tests.support import vllm_engine

    start = time.thread_time_ns()
    vllm_engine.replay_scheduler(scheduler, script, check=check)
    return time.thread_time_ns() - start


def engine_run(
    name: str, pool: int, policy: str, trace: list[FakeRequest], admit: int = 4
) -> tuple[Any, list[Any]]:
    """One engine run of ``trace`` through ``contender(name, pool, policy)``, ``admit``
    requests admitted a step: its report and its scheduler-role calls (for ``replay_cpu``).
    Ours must end with every request closed and its invariants held."""
    scheduler, workers, running = contender(name, pool, policy)
    record: list[Any] = []
    eng = engine(scheduler, workers, record=record, admit=admit)
    for request in trace:
        eng.add(request)
    with running:
        report = eng.drain()
        if name == "embcache":
            scheduler.check_invariants()
            assert scheduler.stats().open_requests == 0
    return report, record


def replay_cpu(
    runs: dict[str, tuple[Any, list[Any]]], pool: int, reps: int, policy: str = "lru"
) -> dict[str, list[float]]:
    """The scheduler CPU us per image of ``runs["embcache"]`` and ``runs["eccpu"]``, each
    replayed alone on a fresh scheduler of ``pool`` bytes (ours with ``policy``), ``reps``
    times, alternating which goes first; less the replay loop's own time."""
    cpu: dict[str, list[float]] = {"embcache": [], "eccpu": []}
    for rep in range(reps):
        for name in ("embcache", "eccpu") if rep % 2 == 0 else ("eccpu", "embcache"):
            report, record = runs[name]
            scheduler, _, running = contender(name, pool, policy)
            with running:
                spent = _replay_cpu_ns(scheduler, record)
            spent -= _replay_cpu_ns(NullScheduler(), record, check=False)
            cpu[name].append(spent / report.images / 1e3)
    return cpu


def by_call(
    runs: dict[str, tuple[Any, list[Any]]], pool: int, reps: int, policy: str
) -> dict[str, dict[str, float]]:
    """Where the scheduler's time goes: per contender (``embcache``, ``eccpu``), per vLLM
    method, the thread CPU us per image of its calls in a replay (``replay_cpu``'s, each call
    timed alone: the clock's own cost is in every call), the median of ``reps``."""
    from vllm.v1.outputs import ECConnectorOutput

    spent: dict[str, dict[str, list[float]]] = {"embcache": {}, "eccpu": {}}
    clock = time.thread_time_ns
    for rep in range(reps):
        for name in ("embcache", "eccpu") if rep % 2 == 0 else ("eccpu", "embcache"):
            report, record = runs[name]
            scheduler, _, running = contender(name, pool, policy)
            total: dict[str, int] = {}
            with running:
                for method, args, _ in record:
                    if method == "update_connector_output":
                        args = (ECConnectorOutput(ec_connector_worker_meta=pickle.loads(args[0])),)
                    fn = getattr(scheduler, method)
                    start = clock()
                    fn(*args)
                    total[method] = total.get(method, 0) + clock() - start
            for method, ns in total.items():
                spent[name].setdefault(method, []).append(ns / report.images / 1e3)
    return {
        name: {method: statistics.median(v) for method, v in methods.items()}
        for name, methods in spent.items()
    }


def side_by_side(requests: int, images: int, reps: int, pool: int = SBS_POOL) -> dict[str, Any]:
    """The engine runs (embcache lru, ECCPUConnector, embcache adaptive), each cache of
    ``pool`` bytes, then the scheduler-only replays of the first two, alternating; see the
    module docstring."""
    from tests.support import vllm_engine

    torch.set_num_threads(1)  # a 2-thread copy waits for whichever thread is descheduled
    trace = workload(requests, images)
    runs = {
        "embcache": engine_run("embcache", pool, "lru", trace),
        "eccpu": engine_run("eccpu", pool, "lru", trace),
        "embcache adaptive": engine_run("embcache", pool, "adaptive", trace),
    }
    cpu = replay_cpu(runs, pool, reps)
    ideal = vllm_engine.ideal_lru(trace, pool, WIDTH_SBS)
    return {"runs": runs, "cpu_us": cpu, "ideal": ideal}


def pressure_workload(
    requests: int, images: int, steps: int = PRESSURE["steps"]
) -> list[FakeRequest]:
    """The issue's workload: ``workload``'s requests, each running ``steps`` steps."""
    from tests.support import vllm_engine

    return vllm_engine.workload(requests, images, steps=(steps, steps))


def pressure(
    requests: int, images: int, reps: int, pools: tuple[float, ...] = POOLS
) -> list[dict[str, Any]]:
    """Per pool (a share of the trace's working set): the engine runs of ours (the
    connector's default policy, and lru), and of ECCPUConnector, ``PRESSURE["admit"]``
    requests admitted a step; the scheduler-only replays of ours and ECCPUConnector's; the
    ideal LRU of the same bytes. Raises ``AssertionError`` when ours declared an item a rank
    then lacked, or the engine met an error with ours."""
    from embcache.integrations.vllm import ConnectorOptions
    from tests.support import vllm_engine

    default = ConnectorOptions().policy  # what the connector runs unless told otherwise
    torch.set_num_threads(1)
    trace = pressure_workload(requests, images)
    working = vllm_engine.working_set(trace, WIDTH_SBS)
    out = []
    for share in pools:
        pool = int(working * share)
        admit = PRESSURE["admit"]
        runs = {
            "embcache": engine_run("embcache", pool, default, trace, admit),
            "eccpu": engine_run("eccpu", pool, "lru", trace, admit),
            "embcache lru": engine_run("embcache", pool, "lru", trace, admit),
        }
        for name in ("embcache", "embcache lru"):
            report = runs[name][0]
            assert report.missing == 0 and not report.errors, (name, share, report.errors[:3])
        out.append({
            "share": share, "pool": pool, "runs": runs,
            "cpu_us": replay_cpu(runs, pool, reps, default),
            "by_call": by_call(runs, pool, max(1, reps // 3), default),
            "ideal": vllm_engine.ideal_lru(trace, pool, WIDTH_SBS),
        })  # fmt: skip
    return out


def pressure_rows(quick: bool, tiny: bool = False) -> list[dict[str, Any]]:
    """The rows of the pool sweep (module docstring), per pool."""
    if tiny:
        got = pressure(TINY_PRESSURE["requests"], TINY_PRESSURE["images"], 1)
    else:
        got = pressure(PRESSURE["requests"], PRESSURE["images"], 3 if quick else 9)
    rows = []
    row = make_row
    for one in got:
        runs, cpu, ideal = one["runs"], one["cpu_us"], one["ideal"]
        ours, theirs, lru = (runs[k][0] for k in ("embcache", "eccpu", "embcache lru"))
        o, t = statistics.median(cpu["embcache"]), statistics.median(cpu["eccpu"])
        name = f"vllm pool {one['share']:g}x working set:"
        rows += [
            row(f"{name} scheduler CPU/image vs ECCPUConnector", o, t, "us", o / t, "<= 1.0x",
                o / t <= 1.0),
            row(f"{name} not encoded vs ideal LRU", ours.avoided, ideal, "share",
                ours.avoided - ideal, ">= 0", ours.avoided >= ideal - EPS),
            row(f"{name} declared, missing vs ECCPUConnector", ours.missing, theirs.missing,
                "items", 0.0, "0", ours.missing == 0),
            row(f"{name} lru: not encoded vs ideal LRU", lru.avoided, ideal, "share",
                lru.avoided - ideal, "", None),
            row(f"{name} ECCPUConnector: not encoded vs ideal LRU", theirs.avoided, ideal,
                "share", theirs.avoided - ideal, "", None),
        ]  # fmt: skip
        calls = one["by_call"]
        for method, o in calls["embcache"].items():
            t = calls["eccpu"].get(method, 0.0)
            rows.append(row(f"{name} {method} CPU/image vs ECCPUConnector", o, t, "us",
                            o / t if t else 0.0, "", None))  # fmt: skip
    return rows


def side_by_side_rows(quick: bool, tiny: bool = False) -> list[dict[str, Any]]:
    """The side-by-side rows of the module docstring."""
    requests = 60 if quick else WORKLOAD["requests"]
    if tiny:
        got = side_by_side(TINY["requests"], TINY["images"], TINY["reps"], TINY["pool"])
    else:
        got = side_by_side(requests, WORKLOAD["images"], 3 if quick else 9)
    runs, cpu, ideal = got["runs"], got["cpu_us"], got["ideal"]
    ours, theirs, adaptive = (runs[k][0] for k in ("embcache", "eccpu", "embcache adaptive"))
    o, t = statistics.median(cpu["embcache"]), statistics.median(cpu["eccpu"])
    row = make_row
    name = "vllm vs ECCPUConnector:"
    wall_o, wall_t = (r.scheduler_ns / r.images / 1e3 for r in (ours, theirs))
    load = [r.load_bytes * 2 / max(r.load_ns, 1) for r in (ours, theirs)]
    return [
        row(f"{name} scheduler CPU/image", o, t, "us", o / t, "<= 1.0x", o / t <= 1.0),
        row(f"{name} in-engine wall/image", wall_o, wall_t, "us", wall_o / wall_t, "", None),
        row(f"{name} images", ours.images, theirs.images, "items", 1.0, "", None),
        row(f"{name} engine errors", len(ours.errors), len(theirs.errors), "items", 0.0, "0",
            not ours.errors),
        row(f"{name} declared present", ours.declared, theirs.declared, "items", 1.0, "", None),
        row(f"{name} declared, missing", ours.missing, theirs.missing, "items", 0.0, "0",
            ours.missing == 0),
        row(f"{name} loaded", ours.loaded, theirs.loaded, "items", 1.0, "", None),
        row(f"{name} load in run", load[0], load[1], "GB/s", load[0] / load[1], "", None),
        row("vllm images not encoded vs ideal LRU", ours.avoided, ideal, "share",
            ours.avoided - ideal, ">= -0.005", ours.avoided >= ideal - 0.005),
        row("vllm adaptive: not encoded vs ideal LRU", adaptive.avoided, ideal, "share",
            adaptive.avoided - ideal, "> 0", adaptive.avoided > ideal),
        row("ECCPUConnector: not encoded vs ideal LRU", theirs.avoided, ideal, "share",
            theirs.avoided - ideal, "", None),
    ]  # fmt: skip


class Floor:
    """The cheapest ``has_cache_item`` any connector could offer vLLM: an instance attribute
    bound to a dict's ``__contains__``, called as vLLM calls the connector's method."""

    def __init__(self, present: dict[str, int]) -> None:
        self.has = present.__contains__


def scheduler_rows(quick: bool, tiny: bool = False) -> list[dict[str, Any]]:
    """``has_cache_item`` for a held item against a plain dict lookup."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    extra = {"pool_bytes": 8 * MB}
    sched = ECConnectorFactory.create_connector(
        vllm_config("ec_both", extra, 2), ECConnectorRole.SCHEDULER
    )
    try:
        keys = [f"img-{i}" for i in range(64)]
        with sched._scheduler.cache.request("seed") as seed:  # the items, READY and idle
            seed.insert(keys, [torch.randn(16, 64).half() for _ in keys], publish=False)
        plain = dict.fromkeys(keys, 1)
        holder = FakeRequest("holder", keys, dict.fromkeys(keys, 16), 1)
        assert sched.ensure_cache_available(holder, 0)

        def query(rep: int) -> None:
            for key in keys:
                sched.has_cache_item(key)

        def lookup(rep: int) -> None:
            for key in keys:
                _ = key in plain

        bare = Floor(plain)

        def floor(rep: int) -> None:
            for key in keys:
                bare.has(key)

        chunks, reps = TINY["chunks"] if tiny else SCHEDULER_CHUNKS[quick]
        ours_ns: list[float] = []
        base_ns: list[float] = []
        floor_ns: list[float] = []
        for chunk in range(chunks):  # rotate which goes first
            turns = [(ours_ns, query), (base_ns, lookup), (floor_ns, floor)]
            for into, fn in turns[chunk % 3 :] + turns[: chunk % 3]:
                into += _median_ns(fn, len(keys), 1, reps)
        o, b = statistics.median(ours_ns), statistics.median(base_ns)
        f = statistics.median(floor_ns)
        sched.check_invariants()
        return [
            make_row("vllm scheduler: has_cache_item", o, b, "ns/item", o / b, "<= 2x", o / b <= 2),
            make_row("vllm scheduler: has_cache_item vs a bare C call", o, f, "ns/item", o / f,
                     "", None),
            make_row("floor: a bare C call vs key in dict", f, b, "ns/item", f / b, "", None),
        ]  # fmt: skip
    finally:
        sched.shutdown()


def _load_rates(
    size: int, quick: bool, device: torch.device, pool_bytes: int = POOL_BYTES
) -> tuple[float, float]:
    """Median GB/s of ``start_load_caches``'s copy and of the raw copy, for ``size`` items
    cycling through ``pool_bytes``."""
    from embcache.integrations.vllm import EmbcacheECMetadata, Transfer
    from embcache.integrations.vllm.shm import SharedPool
    from embcache.integrations.vllm.worker import WorkerSide

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    count = max(2, pool_bytes // size)
    shape = (size // 2 // WIDTH, WIDTH)
    pool = SharedPool(size * count)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-thread copy waits for whichever thread is descheduled
    try:
        pool.tensor.view(torch.float16)[:] = 1.5
        transfers = [Transfer(f"k{i}", i * size, shape, torch.float16) for i in range(count)]
        metas = [EmbcacheECMetadata(i, pool.handle, [t]) for i, t in enumerate(transfers)]
        raws = [pool.tensor[t.offset : t.offset + size].view(torch.float16) for t in transfers]
        worker = WorkerSide(0, device)
        cache: dict[str, torch.Tensor] = {}

        def ours(i: int) -> None:
            worker.load(metas[i % count], cache)
            sync()
            cache.clear()
            worker.acks()

        def raw(i: int) -> None:
            out = {"k": raws[i % count].view(shape).to(device, copy=True)}
            sync()
            out.clear()

        ours(0)
        assert worker.acks() is None  # ours(0) took its own ack
        reps = max(1, 16 * MB // size)
        chunks = (10 if quick else 60) * (2 if size < 64 * MB else 1)
        rates: dict[str, list[float]] = {"ours": [], "raw": []}
        for chunk in range(chunks):
            order = [("ours", ours), ("raw", raw)]
            for name, fn in order if chunk % 2 else reversed(order):
                start = time.perf_counter()
                for rep in range(reps):
                    fn(chunk * reps + rep)
                rates[name].append(size * reps / (time.perf_counter() - start) / 1e9)
        return statistics.median(rates["ours"]), statistics.median(rates["raw"])
    finally:
        torch.set_num_threads(threads)
        pool.close()


def worker_rows(quick: bool, tiny: bool = False) -> list[dict[str, Any]]:
    """The copy rows of the module docstring, one per item size."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, pool = (TINY_COPY["sizes"], TINY_COPY["pool"]) if tiny else (SIZES, POOL_BYTES)
    rows = []
    for size in sizes:
        o, b = _load_rates(size, quick or tiny, device, pool)
        name = f"vllm worker: load {size / MB:g} MB items to {device.type}"
        target = f">= {TARGET}x raw"
        rows.append(make_row(name, o, b, "GB/s", o / b, target, o / b >= TARGET))
    return rows


def _steady_malloc() -> None:
    """Make glibc keep freed blocks below 32 MB for reuse (no adaptive mmap threshold, no
    trimming), so that both contenders' fresh 4 MB tensors come from reused memory, not, by
    chance, from new pages that fault in: without it a run is bimodal (2 or 12 GB/s)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 * MB)
    libc.mallopt(m_trim_threshold, 1 << 30)


def run(quick: bool = False, tiny: bool = False, pools: bool = False) -> list[dict[str, Any]]:
    """Every row of the module docstring (``pools``: only the pool sweep's); skipped rows
    where vLLM's wheel cannot be had. ``tiny``: the sizes of ``TINY`` and ``TINY_COPY`` (a
    smoke run)."""
    try:
        vllm_wheel.install()
    except vllm_wheel.VLLMUnavailable as exc:
        return [skipped_row("vllm connector", str(exc))]
    _steady_malloc()
    if pools:
        return pressure_rows(quick, tiny)
    rows = side_by_side_rows(quick, tiny) + pressure_rows(quick, tiny)
    return rows + scheduler_rows(quick, tiny) + worker_rows(quick, tiny)


def _callgrind(probe: str, args: list[str]) -> list[int]:
    """Run ``python -m benchmarks.peers.<probe> args`` under callgrind; the totals of its dumps."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cg.out"
        command = [*VALGRIND, f"--callgrind-out-file={out}", sys.executable, "-m"]
        subprocess.run(
            [*command, f"benchmarks.peers.{probe}", *args],
            check=True,
            capture_output=True,
            timeout=3600,
        )
        return dump_totals(out)


def pressure_callgrind_rows(pools: tuple[float, ...] = POOLS) -> list[dict[str, Any]]:
    """The pool sweep's scheduler instructions per image, ours (the connector's default
    policy) against ECCPUConnector's, per pool (``vllm_engine_probe`` with the sweep's
    workload)."""
    vllm_wheel.install()
    from embcache.integrations.vllm import ConnectorOptions
    from tests.support import vllm_engine

    requests, images = PRESSURE["requests"], PRESSURE["images"]
    trace = pressure_workload(requests, images)
    seen = sum(len(r.keys) for r in trace)
    working = vllm_engine.working_set(trace, WIDTH_SBS)
    sweep = [str(PRESSURE["admit"]), str(PRESSURE["steps"]), ConnectorOptions().policy]
    rows = []
    for share in pools:
        probe = [str(requests), str(images), str(int(working * share)), *sweep]
        o, t = (
            _callgrind("vllm_engine_probe", [n, *probe])[0] / seen for n in ("embcache", "eccpu")
        )
        rows.append(make_row(f"vllm pool {share:g}x working set: scheduler/image vs ECCPUConnector",
                             o, t, "instr", o / t, "<= 1.0x", o / t <= 1.0))  # fmt: skip
    return rows


def callgrind_rows(count: int = 20) -> list[dict[str, Any]]:
    """Instruction counts (deterministic where timings are noisy): the scheduler's per image of
    the side-by-side run, ours against ECCPUConnector's (``vllm_engine_probe``); per item of
    ``has_cache_item`` and of a held item's whole life against a dict lookup
    (``vllm_scheduler_probe``); per 4 MB load of the worker side against the raw copy (ratio
    raw / ours, so that >= 0.9 reads as the timed rows do; the copy is memory-bound, so the
    time ratio is closer to 1 than this). Minutes under valgrind."""
    if shutil.which("valgrind") is None:
        return [skipped_row("vllm callgrind rows", "valgrind is not installed")]
    requests, images = WORKLOAD["requests"], WORKLOAD["images"]
    seen = sum(len(r.keys) for r in workload(requests, images))
    probe = [str(requests), str(images), str(SBS_POOL)]
    ours_sbs, theirs_sbs = (
        _callgrind("vllm_engine_probe", [name, *probe])[0] / seen for name in ("embcache", "eccpu")
    )
    query, life, plain, floor = (
        n / (count * 64) for n in _callgrind("vllm_scheduler_probe", [str(count)])
    )
    ours, raw = (n / count for n in _callgrind("vllm_load_probe", [str(count), str(4 * MB)]))
    row = make_row
    return [
        *pressure_callgrind_rows(),
        row("vllm vs ECCPUConnector: scheduler/image", ours_sbs, theirs_sbs, "instr",
            ours_sbs / theirs_sbs, "<= 1.0x", ours_sbs / theirs_sbs <= 1.0),
        row("vllm scheduler: has_cache_item", query, plain, "instr/item", query / plain, "<= 2x",
            query / plain <= 2),
        row("vllm scheduler: has_cache_item vs a bare C call", query, floor, "instr/item",
            query / floor, "", None),
        row("floor: a bare C call vs key in dict", floor, plain, "instr/item", floor / plain,
            "", None),
        row("vllm scheduler: a held item's whole life", life, plain, "instr/item", life / plain,
            "", None),
        row("vllm worker: load 4 MB items (raw / ours)", ours, raw, "instr/load", raw / ours,
            f">= {TARGET}x raw", raw / ours >= TARGET),
    ]  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a smoke run (TINY, TINY_COPY)")
    parser.add_argument("--callgrind", action="store_true", help="instruction counts instead")
    parser.add_argument("--callgrind-pools", action="store_true",
                        help="only the pool sweep's instruction counts")  # fmt: skip
    parser.add_argument("--pools", action="store_true", help="only the pool sweep's timed rows")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the rows as a JSON list")
    options = parser.parse_args()
    if options.callgrind_pools:
        result = pressure_callgrind_rows()
    else:
        result = (
            callgrind_rows()
            if options.callgrind
            else run(options.quick, options.tiny, options.pools)
        )
    print_rows(result)
    if options.json is not None:
        options.json.write_text(json.dumps([json_row(r) for r in result], indent=1) + "\n")
