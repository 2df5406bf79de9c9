"""The vLLM connector's publishes come back after an outage, on a real ``mooncake_master``.

Engine A serves while the master is down: every fresh image is saved into A's pool and its
publish fails. The master restarts; with no request to A, A's backlog is written. Engine B then
serves A's trace: B encodes none of the images A encoded during the outage and still holds (it
loads them from the global store)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from embcache.store.mooncake_master import MooncakeMaster
from tests.support.engines import mooncake_env
from tests.vllm_connector.vllm_replay import LocalRank, Replay, requests, settle

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]


class Recording(Replay):
    """A replay that notes each image its engine encodes: allocated while its scheduler
    declares it absent (``has_cache_item`` False)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.encoded: set[str] = set()
        sched = self.scheduler
        alloc = sched.update_state_after_alloc

        def update_state_after_alloc(request: Any, index: int) -> None:
            key = request.keys[index]
            if not sched.has_cache_item(key):
                self.encoded.add(key)
            alloc(request, index)

        sched.update_state_after_alloc = update_state_after_alloc


def engine(make_scheduler: Callable[..., Any], extra: dict[str, Any], seed: int) -> Recording:
    sched = make_scheduler(extra)
    return Recording(sched, [LocalRank("ec_both", extra, 2, rank) for rank in range(2)], seed=seed)


def test_engine_b_encodes_nothing_engine_a_encoded_during_the_outage_and_holds(
    private_mooncake_master: MooncakeMaster,
    make_scheduler: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    key_prefix: str,
) -> None:
    master = private_mooncake_master
    kwargs = master.store_kwargs()
    for name, value in mooncake_env(master).items():  # its ranks' clients
        monkeypatch.setenv(name, value)
    extra = {
        "pool_bytes": 16 * 1024,  # a few of the 30 images: A holds some of what it encoded
        "mooncake_master": kwargs["master_address"],
        "mooncake_segment": 16 << 20,
        "key_prefix": key_prefix,
    }
    a = engine(make_scheduler, extra, 1)
    cache_a = a.scheduler.scheduler_side.cache
    master.kill()
    trace = requests(40, 30, seed=7)
    for request in trace:
        a.add(request)
    a.drain()
    stats = settle(cache_a)
    assert a.report.errors == [] and stats.publishes_ok == 0 and stats.publishes_failed > 0
    assert stats.publish_backlog > 0

    master.start()
    deadline = time.monotonic() + 60
    while cache_a.stats().publish_backlog:
        assert time.monotonic() < deadline, "A's backlog was never written"
        time.sleep(0.05)
    stats = settle(cache_a)
    held = {k for k, e in cache_a.snapshot().entries.items() if e.state.name == "READY"}
    assert held and stats.publishes_ok >= len(held & a.encoded), stats

    b = engine(make_scheduler, {**extra, "pool_bytes": 256 * 1024}, 2)  # room to load them
    for request in requests(40, 30, seed=7):  # A's trace, as new requests of engine B
        b.add(request)
    b.drain()
    assert b.report.errors == []

    assert not (b.encoded & a.encoded & held), "B encoded what A encoded and holds"
    assert b.scheduler.scheduler_side.cache.stats().loads_ok >= len(a.encoded & held)
    a.scheduler.check_invariants()
    b.scheduler.check_invariants()
