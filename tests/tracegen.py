"""Traces of real cache runs, for validation against the TLA+ spec (``tla/check.py --trace``).

Three sources: the Hypothesis state machine of ``tests/stateful/test_cache_model.py`` (every
example's trace, fences begun and ended as separate steps), multi-threaded runs against an
``FaultInjectingStore`` whose faults make loads complete out of order, fail, raise and end UNKNOWN,
with removes and fences in between, and overlapping fences (two fences in
flight, a key freed by one and QUARANTINED again before the other ends).
``python -m tests.tracegen OUT_DIR --machine N --threaded M`` writes them as JSON lines.
"""

from __future__ import annotations

import argparse
import random
import threading
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from embcache import EmbeddingCache, Item
from embcache.driver.trace import TraceLog
from embcache.testing import Fault, FaultInjectingStore
from tests.stateful.test_cache_model import CacheMachine

Trace = list[dict[str, Any]]


def machine_traces(count: int, seed: int = 0) -> list[Trace]:
    """Traces of ``count`` examples of the cache state machine."""

    sink: list[Trace] = []

    class Collect(CacheMachine):
        trace_sink = sink

    run_state_machine_as_test(
        Collect,
        settings=settings(
            max_examples=count,
            stateful_step_count=40,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    return sink


def threaded_trace(seed: int, threads: int = 4, steps: int = 40) -> Trace:
    """One trace of ``threads`` request loops racing on a tiny pool with a faulty store."""
    rng = random.Random(seed)
    store = FaultInjectingStore(delay_seconds=0.002)
    trace = TraceLog()
    keys = [f"k{i}" for i in range(6)]
    items = {k: Item(k, (64 * (1 + i % 3),), torch.float32) for i, k in enumerate(keys)}
    for k in keys[::2]:
        store.put_object(k, bytes(items[k].nbytes))
    faults = [Fault.DELAY, Fault.DELAY, Fault.FAIL, Fault.UNKNOWN, Fault.RAISE, Fault.SHORT, None]
    for k in keys:
        store.inject(k, rng.choice(faults))
    cache = EmbeddingCache(
        6 * 256, store=store, alignment=256, max_eviction_batch=2, pin_memory=False,
        io_workers=2, trace=trace,
    )

    def worker(index: int) -> None:
        local = random.Random(seed * 100 + index)
        for step in range(steps):
            with cache.request(f"t{index}-{step}") as request:
                chosen = [items[local.choice(keys)] for _ in range(local.randint(1, 3))]
                request.lookup(chosen, reserve_misses=local.random() < 0.5)
                request.wait(timeout=0.05)
                fresh = [it for it, m in zip(chosen, request.fallback_mask(), strict=True) if m]
                if fresh:
                    request.insert([it.key for it in fresh],
                                   [torch.zeros(it.shape, dtype=it.dtype) for it in fresh],
                                   publish=local.random() < 0.5)
                if local.random() < 0.1:
                    cache.remove(local.choice(keys))
                if local.random() < 0.05:
                    cache.fence()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    cache.fence()
    cache.close()
    return trace.events


def overlapping_fence_traces() -> list[Trace]:
    """The schedule of ``tests.support.overlap.requarantine_between_fences``, with a manual
    first fence and with the cache's own."""
    from embcache.driver.fencing import FencePolicy
    from tests.support.helpers import raw
    from tests.support.overlap import UNIT, LimboStore, requarantine_between_fences, tensor

    eager = FencePolicy(max_fraction=0.0, max_age_s=1e9, min_interval_s=0.01,
                        check_interval_s=0.01)  # fmt: skip
    traces = []
    for manual in (True, False):
        store = LimboStore()
        store.put_object("k", raw(tensor(0)))
        trace = TraceLog()
        cache = EmbeddingCache(2 * UNIT, store=store, alignment=UNIT, pin_memory=False,
                               auto_fence=None if manual else eager, trace=trace)  # fmt: skip
        try:
            requarantine_between_fences(cache, store, manual=manual)
        finally:
            store.open_all()
            cache.fence()
            cache.close()
        traces.append(trace.events)
    return traces


def write(traces: list[Trace], out: Path, prefix: str) -> list[Path]:
    """Write each trace as ``out/prefix-NNN.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, events in enumerate(traces):
        log = TraceLog()
        log.events = events
        path = out / f"{prefix}-{i:03d}.jsonl"
        log.write_jsonl(path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--machine", type=int, default=150)
    parser.add_argument("--threaded", type=int, default=50)
    args = parser.parse_args()
    paths = write(machine_traces(args.machine), args.out, "machine")
    paths += write([threaded_trace(s) for s in range(args.threaded)], args.out, "threaded")
    print(f"wrote {len(paths)} traces to {args.out}")


if __name__ == "__main__":
    main()
