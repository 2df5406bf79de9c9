"""The scheduler role under callgrind, in vLLM's engine-step order (``tests.support.vllm_engine``):
collection is on only inside the scheduler-role calls (torch's ``_valgrind_toggle`` around
each; run with ``--collect-atstart=no``), one dump at the end; prints the item count.

    valgrind --tool=callgrind --collect-atstart=no \\
        python -m benchmarks.peers.vllm_engine_probe {embcache,eccpu} REQUESTS IMAGES POOL_BYTES \\
            [ADMIT STEPS POLICY]

With ADMIT, STEPS and POLICY: the pool sweep's workload (``bench_vllm.pressure_workload``:
every request runs STEPS steps; ADMIT requests admitted a step; ours with POLICY).
"""

from __future__ import annotations

import gc
import sys

import torch

from benchmarks.peers import bench_vllm


def main(
    contender: str, requests: int, images: int, pool_bytes: int, sweep: list[str] | None = None
) -> None:
    """One run of the workload (``bench_vllm.WORKLOAD``'s shape, or with ``sweep`` = [admit,
    steps, policy] the pool sweep's) through ``contender``."""
    policy, admit = (sweep[2], int(sweep[0])) if sweep else ("lru", 4)
    scheduler, workers, closing = bench_vllm.contender(contender, pool_bytes, policy)
    toggle = torch._C._valgrind_toggle

    def on_call(entering: bool) -> None:
        toggle()

    engine = bench_vllm.engine(
        scheduler, workers, on_scheduler_call=on_call, check_bytes=False, admit=admit
    )
    if sweep:
        trace = bench_vllm.pressure_workload(requests, images, int(sweep[1]))
    else:
        trace = bench_vllm.workload(requests, images)
    for request in trace:
        engine.add(request)
    gc.collect()
    with closing:
        report = engine.drain()
    toggle()
    torch._C._valgrind_toggle_and_dump_stats()
    print(report.images, report.declared, report.missing)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] or None)
