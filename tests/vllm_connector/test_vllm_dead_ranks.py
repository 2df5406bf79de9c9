"""Ranks that die and ranks that are slow (embcache/DESIGN.md, "Dead or slow"): the vLLM
connector frees nothing a rank might still read or write until it knows the rank is dead, and it
knows only from the rank's worker process (``embcache.integrations.vllm.ranks``), never from the
hold timeout. The workers here are real processes (``sleep``), killed with SIGKILL.

An overdue fill ends UNKNOWN (its waiters encode instead of waiting), but its range stays
quarantined: the cache's fence frees nothing while rank 0 may still write it (the connector's
``fence_gate``), until rank 0's late ack or its known death. The plant ``free on a timeout``
(the connector's old rule: the fence frees an overdue fill's range, its writer presumed dead)
must fail ``slow_fill_is_held``: ``test_the_check_fails_on_a_fill_freed_on_a_timeout``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from embcache import InvalidArgumentError
from tests.vllm_connector.vllm_replay import DTYPE, WIDTH, FakeRequest, embedding

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 0.01
EXTRA = {"pool_bytes": 48 * 1024, "hold_timeout_s": TIMEOUT_S}


@pytest.fixture
def worker_process() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Starts stand-in worker processes (they only live); killed at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def output(acks: Any) -> Any:
    from vllm.v1.outputs import ECConnectorOutput

    return ECConnectorOutput(ec_connector_worker_meta=acks)


def acks(
    loaded: dict[int, list[tuple[int, str]]] | None = None,
    saved: dict[tuple[int, str], bool] | None = None,
    alive: dict[int, tuple[str, int]] | None = None,
) -> Any:
    from embcache.integrations.vllm import EmbcacheECWorkerMetadata

    return EmbcacheECWorkerMetadata(loaded or {}, saved or {}, alive or {})


def announce(sched: Any, rank: int, pid: int) -> None:
    """Rank ``rank``'s first acks: it runs in process ``pid`` (on this machine)."""
    from embcache.integrations.vllm.ranks import identity

    sched.update_connector_output(output(acks(alive={rank: (identity().boot, pid)})))


def step(sched: Any, request: FakeRequest) -> Any:
    """One engine step scheduling ``request``: ensure, has_cache_item, alloc, build."""
    from tests.support.vllm_wheel import SchedulerOutput

    assert sched.ensure_cache_available(request, 0)
    for index, key in enumerate(request.keys):
        sched.has_cache_item(key)
        sched.update_state_after_alloc(request, index)
    return sched.build_connector_meta(SchedulerOutput())


def empty_step(sched: Any) -> None:
    from tests.support.vllm_wheel import SchedulerOutput

    sched.build_connector_meta(SchedulerOutput())


def overdue(sched: Any) -> None:
    """The hold timeout passes; the scheduler notices at its next step."""
    time.sleep(TIMEOUT_S * 3)
    empty_step(sched)


def state(sched: Any, key: str) -> str:
    return str(sched.scheduler_side.cache.entry_state(key).name)


def save_owed(sched: Any, key: str = "fresh") -> Any:
    """A request whose fresh output rank 0 must write into a reserved range; it finishes and
    its save ack is overdue. Returns the step's metadata."""
    request = FakeRequest("r1", [key], {key: 8}, 1)
    meta = step(sched, request)
    assert [t.key for t in meta.saves] == [key] and state(sched, key) == "LOADING"
    sched.request_finished(request)
    overdue(sched)
    assert state(sched, key) == "QUARANTINED"  # unreadable; its waiters would encode
    assert sched.scheduler_side.sizes()["writing"] == 1
    return meta


def slow_fill_is_held(sched: Any, key: str = "fresh") -> None:
    """What a slow rank 0 may still write is not freed: the fill's range stays QUARANTINED
    through fences and eviction pressure, and no other entry takes it."""
    cache = sched.scheduler_side.cache
    cache.fence()
    for i in range(20):  # pressure: the pool is 48 KiB, each insert 4 KiB
        with cache.request(f"pressure-{i}") as r:
            r.insert([f"p{i}"], [torch.zeros(32, WIDTH, dtype=DTYPE)], publish=False)
    cache.fence()
    assert state(sched, key) == "QUARANTINED", "a range a slow rank may still write was freed"
    sched.check_invariants()


def test_a_slow_rank_0s_fill_is_never_freed_until_its_late_ack(
    make_scheduler: Callable[..., Any],
) -> None:
    sched = make_scheduler(EXTRA)
    meta = save_owed(sched)
    slow_fill_is_held(sched)
    [save] = meta.saves
    pool = sched.scheduler_side.cache.pool  # rank 0, late, writes and acks
    pool[save.offset : save.offset + save.nbytes].copy_(
        embedding("fresh", 8).view(-1).view(torch.uint8)
    )
    sched.update_connector_output(output(acks(saved={(meta.step, "fresh"): True})))
    assert sched.scheduler_side.sizes()["writing"] == 0
    assert sched.scheduler_side.cache.fence() == 1  # now nothing can write it: freed
    assert state(sched, "fresh") == "ABSENT"
    stats = sched.stats()
    assert stats.quarantined_requests == stats.open_requests == 0
    sched.check_invariants()


def test_the_check_fails_on_a_fill_freed_on_a_timeout(
    make_scheduler: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plant: the fence frees an overdue fill's range at once (its writer presumed dead
    # because its ack is late), as the connector did before it knew dead from slow: its cache
    # is made without the fence gate.
    from embcache import EmbeddingCache

    made = EmbeddingCache.__init__

    def without_gate(self: EmbeddingCache, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **{**kwargs, "fence_gate": None})

    monkeypatch.setattr(EmbeddingCache, "__init__", without_gate)
    sched = make_scheduler(EXTRA)
    save_owed(sched)
    with pytest.raises(AssertionError, match="a slow rank may still write was freed"):
        slow_fill_is_held(sched)


def test_rank_0s_death_ends_its_fills_unknown_and_the_fence_frees_them(
    make_scheduler: Callable[..., Any], worker_process: Callable[[], subprocess.Popen[bytes]]
) -> None:
    sched = make_scheduler(EXTRA)
    rank0, rank1 = worker_process(), worker_process()
    announce(sched, 0, rank0.pid)
    announce(sched, 1, rank1.pid)
    save_owed(sched)
    slow_fill_is_held(sched)  # alive, only slow: held
    kill(rank0)
    slow_fill_is_held(sched)  # dead, but not known before the next step: held
    empty_step(sched)  # the scheduler sees the process gone
    assert sched.scheduler_side.sizes()["writing"] == 0
    stats = sched.stats()
    assert stats.quarantined_requests == stats.open_requests == 0
    assert sched.scheduler_side.cache.fence() == 1
    assert state(sched, "fresh") == "ABSENT"
    # no new fill is reserved without a rank 0 to write it: vLLM just encodes
    meta = step(sched, FakeRequest("r2", ["other"], {"other": 8}, 1))
    assert meta.saves == [] and state(sched, "other") == "ABSENT"
    sched.check_invariants()


def test_a_dead_ranks_loads_are_owed_no_more_a_slow_ranks_are(
    make_scheduler: Callable[..., Any], worker_process: Callable[[], subprocess.Popen[bytes]]
) -> None:
    sched = make_scheduler(EXTRA)
    rank1 = worker_process()
    announce(sched, 1, rank1.pid)
    cache = sched.scheduler_side.cache
    with cache.request("seed") as r:
        r.insert(["a"], [embedding("a", 8)], publish=False)
    request = FakeRequest("r1", ["a"], {"a": 8}, 1)
    meta = step(sched, request)
    assert [t.key for t in meta.loads] == ["a"]
    sched.update_connector_output(output(acks(loaded={0: [(meta.step, "a")]})))
    sched.request_finished(request)
    overdue(sched)
    overdue(sched)
    assert sched.stats().quarantined_requests == 1 and cache.stats().pinned_entries == 1
    assert cache.clear() == 1 and state(sched, "a") == "READY"  # doomed, held for rank 1
    kill(rank1)
    empty_step(sched)
    assert state(sched, "a") == "ABSENT", "rank 1 is dead: nothing waits for its copy"
    assert sched.stats().open_requests == cache.stats().pinned_entries == 0
    # a new load awaits rank 0 alone
    with cache.request("seed-b") as r:
        r.insert(["b"], [embedding("b", 8)], publish=False)
    request = FakeRequest("r2", ["b"], {"b": 8}, 1)
    meta = step(sched, request)
    sched.update_connector_output(output(acks(loaded={0: [(meta.step, "b")]})))
    sched.request_finished(request)
    assert sched.stats().open_requests == cache.stats().pinned_entries == 0
    sched.check_invariants()


def test_a_rank_not_known_to_run_here_is_slow_for_ever(
    make_scheduler: Callable[..., Any], worker_process: Callable[[], subprocess.Popen[bytes]]
) -> None:
    sched = make_scheduler(EXTRA)
    elsewhere = worker_process()
    # rank 0 announces a process of another machine (another boot id): never found dead here
    sched.update_connector_output(output(acks(alive={0: ("another-machine", elsewhere.pid)})))
    save_owed(sched)
    kill(elsewhere)
    for _ in range(3):
        overdue(sched)
    slow_fill_is_held(sched)
    assert sched.scheduler_side.sizes()["writing"] == 1


def test_a_rank_that_exited_before_it_was_watched_is_dead(
    make_scheduler: Callable[..., Any], worker_process: Callable[[], subprocess.Popen[bytes]]
) -> None:
    sched = make_scheduler(EXTRA)
    gone = worker_process()
    save_owed(sched)
    kill(gone)
    slow_fill_is_held(sched)
    announce(sched, 0, gone.pid)  # its first acks arrive after it exited
    assert sched.scheduler_side.cache.fence() == 1 and state(sched, "fresh") == "ABSENT"


def test_rank_died_checks_its_rank(make_scheduler: Callable[..., Any]) -> None:
    side = make_scheduler(EXTRA).scheduler_side
    for bad in (-1, 2, True, "0"):
        with pytest.raises(InvalidArgumentError, match="rank must be in"):
            side.rank_died(bad)
    assert side.stats().open_requests == 0


def test_a_worker_announces_its_process_in_its_first_acks() -> None:
    from embcache.integrations.vllm.ranks import identity
    from embcache.integrations.vllm.worker import WorkerSide

    worker = WorkerSide(1, torch.device("cpu"))
    first = worker.acks()
    assert first is not None and first.alive == {1: (identity().boot, os.getpid())}
    assert first.loaded == {} and first.saved == {}
    assert worker.acks() is None  # once


def test_a_fence_gate_that_is_not_callable_is_refused() -> None:
    from embcache import EmbeddingCache, InvalidTypeError

    with pytest.raises(InvalidTypeError, match="fence_gate must be callable"):
        EmbeddingCache(1 << 16, pin_memory=False, fence_gate=True)  # type: ignore[arg-type]


def test_a_closed_fence_gate_frees_nothing_until_it_opens() -> None:
    from embcache import EmbeddingCache, Item

    writing = [True]
    with EmbeddingCache(1 << 16, pin_memory=False, fence_gate=lambda: not writing[0]) as cache:
        with cache.request("r") as r:
            [offset] = r.begin_fill([Item("k", (8, WIDTH), DTYPE)])
            assert offset is not None
        assert cache.entry_state("k").name == "QUARANTINED"  # a fill never ended: UNKNOWN
        assert cache.fence() == 0 and cache.entry_state("k").name == "QUARANTINED"
        cache.check_invariants()
        writing[0] = False
        assert cache.fence() == 1 and cache.entry_state("k").name == "ABSENT"
