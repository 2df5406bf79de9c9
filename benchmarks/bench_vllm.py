"""The vLLM connector's costs, each measured side by side with its baseline in one run.

Scheduler side, per item: (1) ``has_cache_item`` for an item the current request holds,
against a plain ``key in dict`` lookup (what a connector with no pins would do); (2) an item's
whole life in the scheduler: ``ensure_cache_available`` (a hit, pinned), ``has_cache_item``,
``update_state_after_alloc``, ``build_connector_meta``, both ranks' acks through
``update_connector_output``, ``request_finished`` (the unpin), against the same dict lookup.
These are costs (ns per item; ratio = ours / dict), reported, with no target.

Worker side: ``start_load_caches`` copying 4 MB and 64 MB float16 items out of the shared
pool into new tensors in ``encoder_cache`` (the metadata walk, the views, the dict and the
acks included), against a raw ``view.to(device, copy=True)`` of the same bytes. The items
cycle through a pool of at least 128 MB so the bytes come from memory; torch copies with one
intra-op thread while measured, and glibc keeps freed blocks under 32 MB for reuse (both
contenders allocate a fresh tensor per item; whether it faults in new pages would otherwise
decide the ratio); chunks alternate between contenders; GB/s is the median.
Target: ours at least 0.9 of raw. With CUDA the copies go to the GPU (synchronized); this
machine has none, so the CUDA path is not measured here.

vLLM's interface comes from its wheel (``benchmarks.vllm_wheel``). The machine may be shared
with other jobs: read the ratios, not the absolute numbers.
With ``--callgrind`` the same comparisons are counted in instructions under valgrind
(``benchmarks/vllm_scheduler_probe.py``, ``benchmarks/vllm_load_probe.py``): deterministic
where the timings on a loaded machine are not.
Run from the repository root: python -m benchmarks.bench_vllm [--quick | --callgrind]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
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

from benchmarks import vllm_wheel
from benchmarks.common import make_row, print_rows, skipped_row
from benchmarks.vllm_wheel import FakeRequest, vllm_config

MB = 1 << 20
SIZES = (4 * MB, 64 * MB)
WIDTH = 1024
TARGET = 0.9
POOL_BYTES = 128 * MB
VALGRIND = ("valgrind", "--tool=callgrind", "--collect-atstart=no")
SCHEDULER_CHUNKS = {True: (10, 20), False: (40, 50)}  # (chunks, requests a chunk), by --quick


def _median_ns(fn: Callable[[int], None], per_call: int, chunks: int, reps: int) -> list[float]:
    """ns per item of ``fn(rep)`` over ``chunks`` chunks of ``reps`` calls."""
    out = []
    for _ in range(chunks):
        start = time.perf_counter_ns()
        for rep in range(reps):
            fn(rep)
        out.append((time.perf_counter_ns() - start) / (reps * per_call))
    return out


def scheduler_rows(quick: bool) -> list[dict[str, Any]]:
    """Rows (1) and (2) of the module docstring."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.v1.outputs import ECConnectorOutput

    from embcache.integrations.vllm import EmbcacheECWorkerMetadata

    extra = {"pool_bytes": 8 * MB, "staging_bytes": MB}
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
        so = vllm_wheel.SchedulerOutput()

        def query(rep: int) -> None:
            for key in keys:
                sched.has_cache_item(key)

        def lookup(rep: int) -> None:
            for key in keys:
                _ = key in plain

        counter = iter(range(10**9))

        def life(rep: int) -> None:
            request = FakeRequest(f"r{next(counter)}", keys, holder.rows, 1)
            sched.ensure_cache_available(request, 0)
            for index, key in enumerate(keys):
                sched.has_cache_item(key)
                sched.update_state_after_alloc(request, index)
            meta = sched.build_connector_meta(so)
            done = [(meta.step, t.key) for t in meta.loads]
            acks = EmbcacheECWorkerMetadata({0: done}).aggregate(
                EmbcacheECWorkerMetadata({1: done})
            )
            sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=acks))
            sched.request_finished(request)

        chunks, reps = SCHEDULER_CHUNKS[quick]
        rows = []
        for name, ours in (("has_cache_item", query), ("an item's whole life", life)):
            ours_ns, base_ns = [], []
            for chunk in range(chunks):  # alternate which goes first
                pair = [(ours_ns, ours), (base_ns, lookup)]
                for into, fn in pair if chunk % 2 else reversed(pair):
                    into += _median_ns(fn, len(keys), 1, reps)
            o, b = statistics.median(ours_ns), statistics.median(base_ns)
            rows.append(make_row(f"vllm scheduler: {name}", o, b, "ns/item", o / b, "", None))
        sched.check_invariants()
        assert sched.stats().open_requests == 1  # the holder; every measured request closed
        return rows
    finally:
        sched.shutdown()


def _load_rates(size: int, quick: bool, device: torch.device) -> tuple[float, float]:
    """Median GB/s of ``start_load_caches``'s copy and of the raw copy, for ``size`` items."""
    from embcache.integrations.vllm import EmbcacheECMetadata, Transfer
    from embcache.integrations.vllm.shm import SharedPool
    from embcache.integrations.vllm.worker import WorkerSide

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    count = max(2, POOL_BYTES // size)
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


def worker_rows(quick: bool) -> list[dict[str, Any]]:
    """The copy rows of the module docstring, one per item size."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for size in SIZES:
        o, b = _load_rates(size, quick, device)
        name = f"vllm worker: load {size // MB} MB items to {device.type}"
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


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every row of the module docstring; skipped rows where vLLM's wheel cannot be had."""
    try:
        vllm_wheel.install()
    except vllm_wheel.VLLMUnavailable as exc:
        return [skipped_row("vllm connector", str(exc))]
    _steady_malloc()
    return scheduler_rows(quick) + worker_rows(quick)


def dump_totals(out: Path) -> list[int]:
    """The ``totals:`` instruction count of each callgrind dump ``out.1``, ``out.2``, ..."""
    counts = []
    for n in range(1, 10):
        dump = out.with_name(f"{out.name}.{n}")
        if not dump.exists():
            break
        lines = dump.read_text().splitlines()
        counts.append(next(int(x.split()[1]) for x in lines if x.startswith("totals:")))
    return counts


def _callgrind(probe: str, args: list[str]) -> list[int]:
    """Run ``python -m benchmarks.<probe> args`` under callgrind; the totals of its dumps."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "cg.out"
        command = [*VALGRIND, f"--callgrind-out-file={out}", sys.executable, "-m"]
        subprocess.run(
            [*command, f"benchmarks.{probe}", *args],
            check=True,
            capture_output=True,
            timeout=3600,
        )
        return dump_totals(out)


def callgrind_rows(count: int = 20) -> list[dict[str, Any]]:
    """Instruction counts (deterministic where timings are noisy): per item of the scheduler
    side against a dict lookup (ratio ours / dict), and per 4 MB load of the worker side
    against the raw copy (ratio raw / ours, so that >= 0.9 reads as the timed rows do; the copy
    is memory-bound, so the time ratio is closer to 1 than this). Minutes under valgrind."""
    if shutil.which("valgrind") is None:
        return [skipped_row("vllm callgrind rows", "valgrind is not installed")]
    query, life, plain = (
        n / (count * 64) for n in _callgrind("vllm_scheduler_probe", [str(count)])
    )
    ours, raw = (n / count for n in _callgrind("vllm_load_probe", [str(count), str(4 * MB)]))
    return [
        make_row(
            "vllm scheduler: has_cache_item", query, plain, "instr/item", query / plain, "", None
        ),
        make_row(
            "vllm scheduler: an item's whole life",
            life,
            plain,
            "instr/item",
            life / plain,
            "",
            None,
        ),
        make_row(
            "vllm worker: load 4 MB items (raw / ours)",
            ours,
            raw,
            "instr/load",
            raw / ours,
            f">= {TARGET}x raw",
            raw / ours >= TARGET,
        ),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--callgrind", action="store_true", help="instruction counts instead")
    options = parser.parse_args()
    print_rows(callgrind_rows() if options.callgrind else run(options.quick))
