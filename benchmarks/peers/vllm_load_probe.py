"""The worker-side copy under callgrind: ``ours`` (``WorkerSide.load`` of one item, its dict
and its ack) and ``raw`` (``view.to(copy=True)``), ``count`` times each, with collection on only
around each loop (torch's ``_valgrind_toggle``; run with ``--collect-atstart=no``): two dumps,
ours then raw. Instruction counts do not see memory stalls, so they measure what ours does
beyond the copy, not the bandwidth.

    valgrind --tool=callgrind --collect-atstart=no \\
        python -m benchmarks.peers.vllm_load_probe 20 4194304
"""

from __future__ import annotations

import gc
import sys

import torch

from tests.support import vllm_wheel


def main(count: int, nbytes: int) -> None:
    """Each contender ``count`` times on items of ``nbytes`` bytes, one dump each."""
    vllm_wheel.install()  # before the connector's package, which imports vLLM's base
    from embcache.integrations.vllm.protocol import EmbcacheECMetadata, Transfer
    from embcache.integrations.vllm.shm import SharedPool
    from embcache.integrations.vllm.worker import WorkerSide

    torch.set_num_threads(1)
    shape = (nbytes // 2 // 64, 64)
    pool = SharedPool(nbytes * 4)
    meta = EmbcacheECMetadata(0, pool.handle, [Transfer("k", 0, shape, torch.float16)])
    raw = pool.tensor[:nbytes].view(torch.float16).view(shape)
    worker = WorkerSide(0, torch.device("cpu"))
    cache: dict[str, torch.Tensor] = {}
    for _ in range(2):  # attach, and warm both paths, outside the counts
        worker.load(meta, cache)
        cache.clear()
        worker.acks()
        out = {"k": raw.to("cpu", copy=True)}
        out.clear()
    gc.collect()
    torch._C._valgrind_toggle()
    for _ in range(count):
        worker.load(meta, cache)
        cache.clear()
        worker.acks()
    torch._C._valgrind_toggle_and_dump_stats()
    gc.collect()
    torch._C._valgrind_toggle()
    for _ in range(count):
        out = {"k": raw.to("cpu", copy=True)}
        out.clear()
    torch._C._valgrind_toggle_and_dump_stats()
    pool.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
