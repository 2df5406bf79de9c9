"""The vLLM connector configured as docs/vllm.md shows, with a real ``mooncake_master``
holds at most its stated budget however many distinct images pass: the budget is
``pool_bytes`` of shared memory plus the ``mooncake_segment`` it lends the store; 10x that
budget of distinct images pass through both roles in vLLM's order and neither the process's
resident memory nor Python's heap grows by a fraction of it (the master evicts the store's
objects by its own budget)."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest

from embcache.store.mooncake_master import MooncakeMaster
from tests.support.engines import mooncake_env
from tests.support.helpers import rss
from tests.support.vllm_engine import Engine
from tests.vllm_connector.vllm_replay import WIDTH, FakeRequest, settle, vllm_config

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]


def test_a_connector_with_a_master_holds_its_budget_with_10x_of_it_passing(
    private_mooncake_master: MooncakeMaster,
    vllm_base: Any,
    monkeypatch: pytest.MonkeyPatch,
    key_prefix: str,
) -> None:
    """docs/vllm.md's options (``pool_bytes``, ``mooncake_master``; a segment lent, so the
    master has room), scaled down: a 1 MiB pool and the smallest segment Mooncake takes
    (16 MiB); 170 MiB of distinct 128 KiB images after a warm-up of 34 MiB (the pool and the
    segment full): the store keeps taking fresh outputs (its master evicts), the shared memory
    stays exactly ``pool_bytes``, RSS and the traced heap grow by less than a quarter and an
    eighth of the budget."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    kwargs = private_mooncake_master.store_kwargs()
    for name, value in mooncake_env(private_mooncake_master).items():  # its ranks' clients
        monkeypatch.setenv(name, value)
    pool, segment = 1 << 20, 16 << 20
    budget = pool + segment
    extra = {
        "pool_bytes": pool,
        "mooncake_master": kwargs["master_address"],
        "mooncake_segment": segment,
        "key_prefix": key_prefix,
    }
    make = ECConnectorFactory.create_connector
    sched = make(vllm_config("ec_both", extra, 2), ECConnectorRole.SCHEDULER)
    workers = [make(vllm_config("ec_both", extra, 2, r), ECConnectorRole.WORKER) for r in (0, 1)]
    engine = Engine(sched, workers, WIDTH, admit=1)
    rows = 1024
    item = rows * WIDTH * 2
    per_request, warm, count = 4, 2 * budget // item, 12 * budget // item
    try:
        cache = sched.scheduler_side.cache
        assert cache.store is not None
        assert sched.build_connector_meta(object()).pool.size == pool
        tracemalloc.start()
        rss0 = heap0 = 0
        for i in range(count // per_request):
            keys = [f"img-{per_request * i + j}" for j in range(per_request)]
            engine.add(FakeRequest(f"r{i}", keys, dict.fromkeys(keys, rows), 1))
            engine.step()
            if (i + 1) * per_request == warm:
                settle(cache)
                gc.collect()
                rss0, heap0 = rss(), tracemalloc.get_traced_memory()[0]
        stats = settle(cache)
        gc.collect()
        grown, heap = rss() - rss0, tracemalloc.get_traced_memory()[0] - heap0
        tracemalloc.stop()
        assert engine.report.errors == [] and engine.report.images == count
        assert stats.entries * item <= pool and stats.open_requests == 0
        assert grown < budget // 4, f"RSS grew {grown} bytes with {10 * budget} bytes passing"
        assert heap < budget // 8, f"heap grew {heap} bytes with {10 * budget} bytes passing"
        # the master made room: twice what the segment holds was stored (a put that finds it
        # full before its eviction runs fails, and counts as a failed publish)
        assert stats.publishes_ok > 2 * segment // item, stats
        assert sched.build_connector_meta(object()).pool.size == pool
        sched.check_invariants()
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        sched.shutdown()
        for worker in workers:
            worker.shutdown()
