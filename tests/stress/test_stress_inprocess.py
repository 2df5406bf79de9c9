"""Stress: 8 request threads, a monitor and a chaos thread against one cache and one
``FaultInjectingStore`` whose faults change at random (see ``tests/support/stress_workload.py``
for the workload and the end-state checks).

``EMBCACHE_STRESS_SECONDS`` bounds the run (default 3); ``EMBCACHE_STRESS_SEED`` replays a seed
(the seed is printed, and named in every failure). The pool is small (40 units for 24 keys of
1 to 3 units), so eviction, NO_SPACE and contiguity-aware victim choice happen all the time.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import pytest

from embcache import EmbeddingCache
from embcache.driver.fencing import FencePolicy
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import raw, wait_until
from tests.support.stress_workload import Mix, Workload, stress_seed

pytestmark = [pytest.mark.stress, pytest.mark.timeout(120)]

STRESS_SECONDS = float(os.environ.get("EMBCACHE_STRESS_SECONDS", "3"))
UNIT = 1024
FAULTS = [
    None,
    None,
    None,
    Fault.DELAY,
    Fault.DELAY,
    Fault.FAIL,
    Fault.RAISE,
    Fault.UNKNOWN,
    Fault.SHORT,
    Fault.HOLD,
]


def in_process_chaos(
    store: FaultInjectingStore, keys: list[str]
) -> Callable[[random.Random, threading.Event], None]:
    """Every ~2 ms give a random key a random fault; a HOLD is released within 10 ms."""

    def chaos(rng: random.Random, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                key = rng.choice(keys)
                fault = rng.choice(FAULTS)
                store.inject(key, fault)
                if fault is Fault.HOLD:
                    stop.wait(rng.uniform(0.001, 0.01))
                    store.inject(key, None)
                    store.release_holds()
                stop.wait(0.002)
        finally:
            for key in keys:
                store.inject(key, None)
            store.release_holds()

    return chaos


def test_random_requests_with_store_faults_keep_every_invariant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seed = stress_seed()
    print(f"EMBCACHE_STRESS_SEED={seed}")
    store = FaultInjectingStore(delay_seconds=0.003)
    cache = EmbeddingCache(40 * UNIT, store=store, pin_memory=False, io_workers=4)
    try:
        workload = Workload(cache, seed=seed, unit=UNIT)
        for key in workload.keys[::2]:  # half the keys start in the global store
            item = workload.canonical[key]
            store.put_object(key, raw(workload.payloads[item]))
        report = workload.run(STRESS_SECONDS, in_process_chaos(store, workload.keys))
        workload.assert_no_errors()
        workload.finish()
        with capsys.disabled():
            print("\n" + report.line("stress in-process"))
        stats = report.stats
        assert report.invariant_checks > 0 and report.views_checked > 0, workload.where()
        assert stats.hits and stats.evictions and stats.loads_ok, f"{stats}; {workload.where()}"
        assert stats.loads_failed + stats.loads_unknown, f"no fault landed: {stats}"
    finally:
        store.release_holds()
        cache.close()


def test_a_flaky_store_and_no_manual_fence_end_with_the_quarantine_drained(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Nobody calls fence(): the cache's own fencer frees every quarantined range."""
    seed = stress_seed()
    print(f"EMBCACHE_STRESS_SEED={seed}")
    store = FaultInjectingStore(delay_seconds=0.003)
    policy = FencePolicy(max_fraction=0.1, max_age_s=0.5, min_interval_s=0.1)
    cache = EmbeddingCache(
        40 * UNIT, store=store, pin_memory=False, io_workers=4, auto_fence=policy
    )
    try:
        workload = Workload(cache, seed=seed, unit=UNIT, mix=Mix(fence=0.0))
        for key in workload.keys[::2]:
            store.put_object(key, raw(workload.payloads[workload.canonical[key]]))
        report = workload.run(STRESS_SECONDS, in_process_chaos(store, workload.keys))
        workload.assert_no_errors()
        workload.drain()
        wait_until(
            lambda: "QUARANTINED" not in cache.stats().entries_by_state, "the automatic fences"
        )
        workload.check_end_state()
        assert report.stats.fences > 0 or cache.stats().fences > 0, "no automatic fence ran"
        with capsys.disabled():
            print("\n" + report.line("stress, automatic fences only"))
    finally:
        cache.close()
