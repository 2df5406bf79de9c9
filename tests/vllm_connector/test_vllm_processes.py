"""A scheduler-role connector and two worker-role connectors in separate processes (vLLM's own
``ec_transfer_state`` and model-runner mixin in each rank), replaying vLLM's per-step call order
for hundreds of requests under eviction pressure, with lost acks, late acks and a SIGKILLed
rank. Every True of ``has_cache_item`` must be followed by the right bytes, shape and dtype in
every live rank's ``encoder_cache``; no pin may outlive its request except the ones a lost ack
quarantined, and those only until the owing rank's process is seen gone;
``check_invariants()`` after every step."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.vllm_connector.vllm_replay import ProcessRank, Replay, requests, settle

pytestmark = [pytest.mark.stress, pytest.mark.timeout(600)]
# lru: every fresh output is admitted, so the small pool evicts under the replay's pressure
EXTRA = {"pool_bytes": 96 * 1024, "hold_timeout_s": 0.05, "policy": "lru"}


def expire(replay: Replay) -> None:
    """Let the hold timeout pass, then one empty step so the scheduler notices."""
    time.sleep(EXTRA["hold_timeout_s"] * 2)
    replay.step()


def assert_only_quarantine_holds_pins(sched: Any) -> None:
    ours, cache = sched.stats(), settle(sched.scheduler_side.cache)
    assert ours.open_requests == ours.quarantined_requests == cache.open_requests
    assert ours.outstanding_saves == 0
    if ours.quarantined_requests == 0:
        assert cache.pinned_entries == 0 and ours.outstanding_loads == 0


def test_three_processes_lost_acks_and_a_killed_rank(make_scheduler: Callable[..., Any]) -> None:
    sched = make_scheduler(EXTRA)
    ranks = [ProcessRank("ec_both", EXTRA, 2, rank) for rank in range(2)]
    try:
        replay = Replay(sched, ranks)
        rng = random.Random(7)
        for request in requests(300, 60, seed=2):
            replay.add(request)
        while replay.waiting or replay.running:
            replay.step(drop_ack=lambda rank: rank == 1 and rng.random() < 0.08)
            sched.check_invariants()
        report = replay.report
        assert report.errors == []
        assert report.declared > 50 and report.dropped_acks >= 4
        assert sched.scheduler_side.cache.stats().evictions > 20
        late, lost = report.dropped[::2], report.dropped[1::2]
        for acks in late:
            replay.deliver(acks)
        expire(replay)
        sched.check_invariants()
        quarantined = sched.stats().quarantined_requests
        assert 0 < quarantined <= sum(len(a.loaded.get(1, [])) for a in lost)
        assert_only_quarantine_holds_pins(sched)

        ranks[1].kill()
        for request in requests(60, 60, seed=3):
            replay.add(request)
        while replay.waiting or replay.running:
            replay.step()
            sched.check_invariants()
        assert replay.report.errors == []
        expire(replay)
        stats = sched.stats()
        # rank 1's process is gone and the scheduler saw it exit: nothing waits for its
        # copies any more (its lost acks included); a slow rank's would still be held
        assert stats.quarantined_requests == 0 < quarantined and stats.outstanding_loads == 0
        assert_only_quarantine_holds_pins(sched)
        sched.check_invariants()
    finally:
        for rank in ranks:
            rank.stop()
