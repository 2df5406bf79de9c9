"""Two engines on one real ``mooncake_master``: engine A encodes and publishes, engine B loads
what A published (its scheduler defers each request while the store read runs), then the
master dies and B goes on encoding: no rank ever misses an item it was promised."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from embcache.store.mooncake_master import MooncakeMaster
from tests.support.engines import mooncake_env
from tests.vllm_connector.vllm_replay import LocalRank, Replay, requests, settle

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]


def engine(make_scheduler: Callable[..., Any], extra: dict[str, Any], seed: int) -> Replay:
    sched = make_scheduler(extra)
    return Replay(sched, [LocalRank("ec_both", extra, 2, rank) for rank in range(2)], seed=seed)


def run(replay: Replay, count: int, seed: int) -> None:
    for request in requests(count, 30, seed=seed):
        replay.add(request)
    replay.drain()
    replay.scheduler.check_invariants()


def test_one_engine_loads_what_the_other_published_and_survives_the_master(
    private_mooncake_master: MooncakeMaster,
    make_scheduler: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    key_prefix: str,
) -> None:
    kwargs = private_mooncake_master.store_kwargs()
    for name, value in mooncake_env(private_mooncake_master).items():  # its ranks' clients
        monkeypatch.setenv(name, value)
    extra = {
        "pool_bytes": 256 * 1024,
        "mooncake_master": kwargs["master_address"],
        "mooncake_segment": 16 << 20,
        "key_prefix": key_prefix,
    }
    producer = engine(make_scheduler, extra, 1)
    run(producer, 60, seed=4)
    published = settle(producer.scheduler.scheduler_side.cache).publishes_ok
    assert producer.report.errors == [] and published > 10

    consumer = engine(make_scheduler, extra, 2)
    run(consumer, 60, seed=5)
    loaded = consumer.scheduler.scheduler_side.cache.stats()
    assert consumer.report.errors == []
    assert loaded.loads_ok > 5 and consumer.report.declared > 5 and consumer.report.deferred > 0

    private_mooncake_master.kill()
    before = consumer.report.encodes
    run(consumer, 60, seed=6)
    assert consumer.report.errors == [] and consumer.report.encodes > before
    settle(consumer.scheduler.scheduler_side.cache)
    consumer.scheduler.check_invariants()
