"""``benchmarks.peers.bench_sglang_adapter``'s own checks: between requests the run waits for
SGLang's PUTs on SGLang's own signal, not on time, so a lagging putter (a loaded machine) never
makes SGLang skip an insert.

These reach into the benchmark (they replace its ``SGLangSide.settle``), which no test under
``tests/`` may: ``tests/test_benchmarks.py`` runs this file with pytest in a child process.
``tests/sglang_controller/test_sglang_benchmark.py`` runs the benchmark itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.sglang_wheel import SGLangUnavailable, load_controller_module

ROOT = Path(__file__).resolve().parents[2]

# The tiny run in a child whose SGLang store takes 0.1 s per PUT (a loaded machine): SGLang's
# putter falls behind, and each PUT holds its entries' pages until it ends.
LAGGING_PUTTER = """
import sys, time
from tests.support import sglang_wheel
import benchmarks.peers.bench_sglang_adapter as bench
put = sglang_wheel.NullStore.batch_put_from_multi_buffers
def slow_put(self, *args):
    time.sleep(0.1)
    return put(self, *args)
sglang_wheel.NullStore.batch_put_from_multi_buffers = slow_put
if "--plant" in sys.argv:  # wait on time, not on SGLang's own signal
    bench.SGLangSide.settle = lambda self: time.sleep(0.001)
bench.run(tiny=True)
"""


@pytest.mark.parametrize("plant", [False, True], ids=["its own signal", "planted: on time"])
def test_the_run_waits_for_sglangs_puts_on_its_own_signal(plant: bool) -> None:
    """Between requests the run waits for SGLang's PUTs by its insert queue's ``join``, so a
    lagging putter never leaves the next insert without pages. Waiting on time instead (the
    plant: 1 ms) lets the backlog grow past the pool, SGLang skips an insert, and a hit
    request finds a miss."""
    try:
        load_controller_module()
    except SGLangUnavailable as exc:
        pytest.skip(f"sglang 0.5.23's wheel cannot be had here: {exc}")
    command = [sys.executable, "-c", LAGGING_PUTTER, *(["--plant"] if plant else [])]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if plant:
        assert done.returncode != 0 and "a hit request found a miss" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr[-4000:]
