"""The scheduler role's record of dead ranks (``SchedulerSide.deaths``, ``workers``): how and
when each death was learned, what it ended and what it let the fence free. The engine tier's
``tests/engine/test_worker_death.py`` reads the same record from a real engine whose worker
process is SIGKILLed; here the workers are stand-in processes (``sleep``), as in
``tests/vllm_connector/test_vllm_dead_ranks.py``, whose helpers this file uses.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.vllm_connector.test_vllm_dead_ranks import (
    EXTRA,
    announce,
    empty_step,
    kill,
    save_owed,
    step,
    worker_process,
)
from tests.vllm_connector.vllm_replay import FakeRequest, embedding

__all__ = ["worker_process"]
pytestmark = pytest.mark.timeout(120)


def test_a_death_learned_from_the_process_is_recorded_with_what_it_let_the_fence_free(
    make_scheduler: Callable[..., Any], worker_process: Callable[[], subprocess.Popen[bytes]]
) -> None:
    sched = make_scheduler(EXTRA)
    side = sched.scheduler_side
    rank0, rank1 = worker_process(), worker_process()
    announce(sched, 0, rank0.pid)
    announce(sched, 1, rank1.pid)
    assert side.workers() == {0: rank0.pid, 1: rank1.pid}
    save_owed(sched)  # overdue: ended UNKNOWN, still writing
    killed_at = time.monotonic()
    kill(rank0)
    assert side.deaths() == () and side.cache.fence() == 0  # not known before the next step
    empty_step(sched)
    [death] = side.deaths()
    assert (death.rank, death.pid, death.how) == (0, rank0.pid, "process exit")
    assert killed_at < death.learned_at <= time.monotonic()
    assert death.step == side.stats().steps  # learned as that step's metadata was built
    assert death.fills_unfenced == ("fresh",) and death.fills_ended == ()
    assert death.loads_released == 0
    assert side.workers() == {1: rank1.pid} and side.sizes()["deaths"] == 1
    assert side.cache.fence() == 1  # what it let free
    empty_step(sched)
    assert len(side.deaths()) == 1  # each rank once


def test_a_death_the_engine_reports_records_the_loads_and_fills_it_ended(
    make_scheduler: Callable[..., Any],
) -> None:
    sched = make_scheduler(EXTRA)
    side = sched.scheduler_side
    with side.cache.request("seed") as r:
        r.insert(["held"], [embedding("held", 8)], publish=False)
    meta = step(sched, FakeRequest("r1", ["held", "fresh"], {"held": 8, "fresh": 8}, 2))
    assert [t.key for t in meta.loads] == ["held"] and [t.key for t in meta.saves] == ["fresh"]
    side.rank_died(1)
    side.rank_died(0)
    side.rank_died(0)  # again: nothing new
    one, zero = side.deaths()
    assert (one.rank, one.pid, one.how, one.loads_released) == (1, None, "engine", 1)
    assert one.fills_ended == one.fills_unfenced == ()
    assert (zero.rank, zero.how, zero.fills_ended) == (0, "engine", ("fresh",))
    assert zero.loads_released == 1 and zero.learned_at >= one.learned_at
    assert side.cache.entry_state("fresh").name == "QUARANTINED"  # UNKNOWN: a fence frees it
    assert side.cache.fence() == 1 and side.cache.entry_state("fresh").name == "ABSENT"
    assert side.workers() == {}
    sched.check_invariants()
