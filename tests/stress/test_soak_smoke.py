"""The soak benchmark (``benchmarks/soak/stress.py``) for a few seconds: it runs, kills and restarts
the master, fences only automatically, and ends with nothing lost, pinned or open.

The soak itself runs for 30 minutes by hand (README, "Reliability"); this only keeps it
working. It runs in a child process, so Mooncake's logging settings and the resident-memory
numbers are the soak's own. Resident memory over seconds says nothing about a leak, so its
check is not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mooncake, pytest.mark.stress, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

SMOKE = """
import json, sys
from benchmarks.soak.stress import soak
from embcache.driver.fencing import FencePolicy

policy = FencePolicy(max_age_s=0.5, min_interval_s=0.2, check_interval_s=0.1)
result = soak(8.0, kill_every_s=3.0, down_s=1.0, seed=int(sys.argv[1]), warmup_s=1.0,
              policy=policy, progress=False)
print(json.dumps(result))
"""


def test_a_short_soak_ends_with_nothing_lost() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SMOKE, "12345"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    checks = result["checks"]
    del checks["rss_growth_under_5_percent"]  # seconds of RSS say nothing (module docstring)
    assert all(checks.values()), result
    assert result["master_kills"] >= 1 and result["master_restarts"] == result["master_kills"]
    assert result["capacity_lost_after_final_fence"] == 0
    assert (result["pins_left"], result["requests_left"]) == (0, 0)
    assert result["operations"] > 0 and result["invariant_checks_passed"] > 0
    assert sum(result["faults_injected"].values()) > 0, result["faults_injected"]
