"""The scheduler side under callgrind: ``count`` requests of 64 items through (1)
``has_cache_item`` for held items, (2) an item's whole life (ensure, has_cache_item,
update_state_after_alloc, build_connector_meta, both ranks' acks, request_finished), (3) a
plain ``key in dict``, (4) the floor of a connector method: ``obj.has(key)``, ``has`` an
instance attribute bound to the dict's ``__contains__`` (``bench_vllm.Floor``); collection on
only around each loop (torch's ``_valgrind_toggle``; run with ``--collect-atstart=no``): four
dumps, in that order.

    valgrind --tool=callgrind --collect-atstart=no \\
        python -m benchmarks.peers.vllm_scheduler_probe 20
"""

from __future__ import annotations

import gc
import sys

import torch

from benchmarks.peers.bench_vllm import Floor
from tests.support import vllm_wheel

ITEMS = 64


def main(count: int) -> None:
    """Each of the four loops over ``count`` requests of ``ITEMS`` items, one dump each."""
    vllm_wheel.install()
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.v1.outputs import ECConnectorOutput

    from embcache.integrations.vllm import EmbcacheECWorkerMetadata

    config = vllm_wheel.vllm_config("ec_both", {"pool_bytes": 8 << 20}, 2)
    sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    keys = [f"img-{i}" for i in range(ITEMS)]
    with sched._scheduler.cache.request("seed") as seed:
        seed.insert(keys, [torch.randn(16, 64).half() for _ in keys], publish=False)
    rows = dict.fromkeys(keys, 16)
    plain = dict.fromkeys(keys, 1)
    holder = vllm_wheel.FakeRequest("holder", keys, rows, 1)
    assert sched.ensure_cache_available(holder, 0)
    so = vllm_wheel.SchedulerOutput()

    def life(n: int) -> None:
        request = vllm_wheel.FakeRequest(f"r{n}", keys, rows, 1)
        sched.ensure_cache_available(request, 0)
        for index, key in enumerate(keys):
            sched.has_cache_item(key)
            sched.update_state_after_alloc(request, index)
        meta = sched.build_connector_meta(so)
        done = [(meta.step, t.key) for t in meta.loads]
        acks = EmbcacheECWorkerMetadata({0: done}).aggregate(EmbcacheECWorkerMetadata({1: done}))
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=acks))
        sched.request_finished(request)

    life(-1)
    assert sched.ensure_cache_available(holder, 0)
    gc.collect()
    torch._C._valgrind_toggle()
    for _ in range(count):
        for key in keys:
            sched.has_cache_item(key)
    torch._C._valgrind_toggle_and_dump_stats()
    torch._C._valgrind_toggle()
    for n in range(count):
        life(n)
    torch._C._valgrind_toggle_and_dump_stats()
    torch._C._valgrind_toggle()
    for _ in range(count):
        for key in keys:
            _ = key in plain
    torch._C._valgrind_toggle_and_dump_stats()
    bare = Floor(plain)
    torch._C._valgrind_toggle()
    for _ in range(count):
        for key in keys:
            bare.has(key)
    torch._C._valgrind_toggle_and_dump_stats()
    sched.check_invariants()
    sched.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
