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
    (16 MiB); 170 MiB of distinct 128 KiB images after a warm-up of at least 34 MiB that ends
    once the pool and the segment have been full: the store keeps taking fresh outputs (its
    master evicts), the shared memory stays exactly ``pool_bytes``, RSS and the traced heap
    grow by less than a quarter and an eighth of the budget.

    The warm-up ends on what the store took, not on a count of images: the segment's pages are
    resident only once an object has been put there, and while publishes are slow (a loaded
    machine) the pool stays pinned by them, so most images pass without being inserted or
    published; after a count alone the segment could be a few MiB resident and fill during the
    measurement, up to ``segment`` bytes of RSS that are the budget, not a leak."""
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
        "policy": "lru",  # every fresh output admitted: the warm-up fills the pool and segment
    }
    make = ECConnectorFactory.create_connector
    sched = make(vllm_config("ec_both", extra, 2), ECConnectorRole.SCHEDULER)
    workers = [make(vllm_config("ec_both", extra, 2, r), ECConnectorRole.WORKER) for r in (0, 1)]
    engine = Engine(sched, workers, WIDTH, admit=1)
    rows = 1024
    item = rows * WIDTH * 2
    per_request, warm, count = 4, 2 * budget // item, 10 * budget // item
    stored = 2 * segment // item  # puts past the segment's size: its master evicted
    sent = 0  # requests added

    def run(requests: int) -> None:
        nonlocal sent
        for _ in range(requests):
            keys = [f"img-{per_request * sent + j}" for j in range(per_request)]
            engine.add(FakeRequest(f"r{sent}", keys, dict.fromkeys(keys, rows), 1))
            engine.step()
            sent += 1

    try:
        cache = sched.scheduler_side.cache
        assert cache.store is not None
        assert sched.build_connector_meta(object()).pool.size == pool
        tracemalloc.start()
        run(warm // per_request)
        # settled between steps, each step's images are inserted and published
        while settle(cache).publishes_ok <= stored and sent * per_request < warm + count:
            run(1)
        stats = settle(cache)
        assert stats.publishes_ok > stored, f"the warm-up did not fill the segment: {stats}"
        gc.collect()
        rss0, heap0 = rss(), tracemalloc.get_traced_memory()[0]
        published0, sent0 = stats.publishes_ok, sent
        run(count // per_request)
        stats = settle(cache)
        gc.collect()
        grown, heap = rss() - rss0, tracemalloc.get_traced_memory()[0] - heap0
        tracemalloc.stop()
        assert engine.report.errors == [] and engine.report.images == sent * per_request
        assert (sent - sent0) * per_request == count
        assert stats.entries * item <= pool and stats.open_requests == 0
        assert grown < budget // 4, f"RSS grew {grown} bytes with {10 * budget} bytes passing"
        assert heap < budget // 8, f"heap grew {heap} bytes with {10 * budget} bytes passing"
        # the master kept making room: twice what the segment holds was stored after the
        # warm-up too (a put that finds it full before its eviction runs fails, and counts as a
        # failed publish)
        assert stats.publishes_ok - published0 > stored, stats
        assert sched.build_connector_meta(object()).pool.size == pool
        sched.check_invariants()
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        sched.shutdown()
        for worker in workers:
            worker.shutdown()
