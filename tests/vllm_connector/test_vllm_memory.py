"""The vLLM connector's memory (embcache/DESIGN.md, "Memory bounds", "vLLM
connector"): every container of the scheduler role is bounded by the requests vLLM has open
or by one step, and empties when they close; a connector configured as the README shows holds
its budget however many distinct images pass; a short soak of both roles stays flat."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_engine import Engine
from tests.vllm_connector.vllm_replay import WIDTH, FakeRequest, LocalRank, Replay, requests

pytestmark = pytest.mark.timeout(600)
CFG = {"pool_bytes": 48 * 1024, "hold_timeout_s": 0.01}
ROOT = Path(__file__).resolve().parents[2]


def sizes(sched: Any) -> dict[str, int]:
    """Every container of the scheduler role, by name (``SchedulerSide.sizes``), and the
    cache's open requests."""
    side = sched.scheduler_side
    return {**side.sizes(), "cache_requests": side.cache.stats().open_requests}


def test_every_container_is_bounded_by_open_requests_and_empties_when_they_close(
    make_scheduler: Callable[..., Any],
) -> None:
    """3,000 requests over 2,000 keys (a 48 KiB pool: evictions all along), a rank's acks
    lost now and then (rank 0's: its fills end UNKNOWN; either's loads: the request is
    quarantined until they are delivered late): at every step the requests held are ones
    vLLM has not finished or finished ones with an ack owed, the per-step maps are empty once
    the step's metadata is built, and at the end, every request closed, every container is
    empty."""
    sched = make_scheduler(CFG)
    ranks = [LocalRank("ec_both", CFG, 2, r) for r in range(2)]
    replay = Replay(sched, ranks, seed=3)
    for request in requests(3000, 2000, seed=3):
        replay.add(request)
    most = dict.fromkeys(sizes(sched), 0)
    while replay.waiting or replay.running:
        step = replay.report.steps
        lost = {0} if step % 53 == 5 else {1} if step % 37 == 7 else set()
        replay.step(drop_ack=lost.__contains__)
        now = sizes(sched)
        seen = {r.request_id for r in replay.running + replay.waiting}  # not finished
        holds = sched.scheduler_side.holds()  # held: running, or finishing or quarantined
        assert {r for r, why in holds.items() if why == "running"} <= seen
        assert now["cache_requests"] == now["held"]
        assert now["step_loads"] == now["step_saves"] == 0  # per step: gone at build
        for name, size in now.items():
            most[name] = max(most[name], size)
        if replay.report.steps % 50 == 0:
            sched.check_invariants()
    assert replay.report.errors == [] and replay.report.dropped_acks > 10
    assert most["quarantined"] > 0 and most["load_acks"] > 0 and most["save_acks"] > 0
    for acks in replay.report.dropped:  # the late acks end every hold
        replay.deliver(acks)
    sched.check_invariants()
    assert sizes(sched) == dict.fromkeys(most, 0)
    assert sched.scheduler_side.cache.stats().pinned_entries == 0


def test_a_connector_as_the_readme_shows_holds_its_budget_with_10x_of_it_passing(
    vllm_base: Any,
) -> None:
    """The README's vLLM configuration (its options, with a pool of 1 MiB and no Mooncake
    master, so no global tier): 10 MiB of distinct images pass through both roles in vLLM's
    order; the shared memory stays ``pool_bytes``, the cache holds at most that, and Python's
    heap grows by a small fraction of it (metadata, not payload)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from tests.support.vllm_wheel import vllm_config

    pool = 1 << 20
    extra = {"pool_bytes": pool, "policy": "lru"}  # lru: every image enters, 10x pass through
    make = ECConnectorFactory.create_connector
    sched = make(vllm_config("ec_both", extra, 2), ECConnectorRole.SCHEDULER)
    workers = [make(vllm_config("ec_both", extra, 2, r), ECConnectorRole.WORKER) for r in (0, 1)]
    engine = Engine(sched, workers, WIDTH, admit=1)
    item = 32 * WIDTH * 2
    count = 10 * pool // item
    try:
        assert sched.scheduler_side.cache.store is None
        assert sched.build_connector_meta(object()).pool.size == pool
        tracemalloc.start()
        for i in range(count // 4):
            keys = [f"img-{4 * i + j}" for j in range(4)]
            engine.add(FakeRequest(f"r{i}", keys, dict.fromkeys(keys, 32), 1))
            engine.step()
            if i == 10:
                warm = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - warm
        tracemalloc.stop()
        stats = sched.scheduler_side.cache.stats()
        assert engine.report.errors == [] and engine.report.images == count
        assert stats.entries * item <= pool and stats.open_requests == 0
        assert grown < pool // 8, f"heap grew {grown} bytes with {10 * pool} bytes passing"
        sched.check_invariants()
    finally:
        sched.shutdown()
        for worker in workers:
            worker.shutdown()


def test_a_short_soak_of_both_roles_leaves_memory_flat(vllm_base: Any, tmp_path: Path) -> None:
    """``benchmarks/soak/vllm_memory.py`` for 3,000 distinct items and 300 requests, in a child
    process, its heap traced from the soak's start (tracing the imports too takes seconds)."""
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak.vllm_memory", "--trace-soak-only"]
    command += ["--items", "3000", "--requests", "300", "--pool-mib", str(64 / 1024)]
    command += ["--warmup", "0.2", "--heap-slack-kib", "256", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.exists(), done.stderr[-4000:]  # the soak ran to its end
    row = json.loads(out.read_text())
    assert row["pool_bytes"] == 64 * 1024
    # the exit status says whether RSS and the heap's every rise stayed flat, and no error
    flat = row["rss_growth_pct"] < 5 and row["heap_rise_kib"] <= 256
    assert done.returncode == (0 if flat and not row["containers"]["errors"] else 1)
    containers = row["containers"]
    assert containers["errors"] == 0
    assert {k: v for k, v in containers.items() if k not in ("entries", "errors")} == dict(
        cache_requests=0,
        held=0,
        finishing=0,
        quarantined=0,
        load_acks=0,
        save_acks=0,
        step_transfers=0,
        engine_refs=0,
    )
    assert row["rss_growth_pct"] < 5 and row["heap_growth_kib"] < 256, row
