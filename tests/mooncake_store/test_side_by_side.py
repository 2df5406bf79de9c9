"""Two runs of the Mooncake tier on one machine at once (issue 42, "Tests that share a machine").

``test_mmencoder_sequence_on_mooncake[global_hits_between_two_controllers]`` once errored at
set-up while another process on the machine ran Mooncake tests; alone it passed. Each run now
takes its ports from a block of its own (``tests/support/ports.py``). Here two pytest processes
run a Mooncake subset, that test's module among it, side by side, and both pass; with a planted
shared port (every run hands out the same fixed ports, as a hard-coded port would) they do not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SUBSET = [
    "tests/sglang_controller/test_sglang_contract_mooncake.py",  # the test that errored, 2 ranks
    "tests/mooncake_store/test_mooncake_cache.py",
]
SHARED_FIRST = 32000  # the plant's ports: outside every leased block (20000..31999)

# The plant: every call of ``server_ports`` returns the next ports of one fixed sequence, the
# same in every run (no lease): one run never collides with itself, two runs collide.
# Both runs then wait for each other before pytest starts (the slow imports first), so that
# their masters overlap in time: with two other runs loading the machine, one plant run once
# ended its session before the other's began, and both passed.
PLANT = """
import itertools, os, sys, time
import pytest, torch
import tests.support.ports as ports
following = itertools.count({first})
ports.server_ports = lambda count: [next(following) for _ in range(count)]
open(os.path.join({barrier!r}, str(os.getpid())), "w").close()
deadline = time.monotonic() + 300
while len(os.listdir({barrier!r})) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(pytest.main(sys.argv[1:]))
"""


def side_by_side(
    tmp_path: Path, paths: list[str], plant: bool = False
) -> list[tuple[int, str, float]]:
    """Start two pytest processes over ``paths`` at once; (status, output tail, seconds) each."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # each run leases its own block
    started = time.monotonic()
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    runs = []
    for i in range(2):
        planted = PLANT.format(first=SHARED_FIRST, barrier=str(barrier))
        head = ["-c", planted] if plant else ["-m", "pytest"]
        args = ["-q", "-x", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / f"run{i}")]
        log = (tmp_path / f"run{i}.log").open("w")
        command = [sys.executable, *head, *args, *paths]
        runs.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log), log))
    results = []
    for process, log in runs:
        try:
            status = process.wait(timeout=500)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
        tail = Path(log.name).read_text(errors="replace")[-3000:]
        results.append((status, tail, time.monotonic() - started))
    return results


def test_two_runs_of_a_mooncake_subset_side_by_side_both_pass(tmp_path: Path) -> None:
    results = side_by_side(tmp_path, SUBSET)
    for status, tail, seconds in results:
        assert status == 0, f"a run failed after {seconds:.0f} s:\n{tail}"
        assert "passed" in tail and "error" not in tail.lower(), tail


def test_a_shared_port_makes_two_runs_side_by_side_fail(tmp_path: Path) -> None:
    """The plant: both runs start their session's master on the same fixed ports; the one
    that comes second cannot serve there, and its tests error at set-up."""
    results = side_by_side(tmp_path, SUBSET[1:], plant=True)
    failed = [tail for status, tail, _ in results if status != 0]
    assert failed, "two runs sharing fixed ports both passed:\n" + results[0][1]
    assert any("mooncake_master" in tail for tail in failed), failed
