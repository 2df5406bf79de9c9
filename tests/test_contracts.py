"""CrossHair checks the PEP 316 contracts of the pure parts: no counterexample may exist.

Checked: ``align_up`` (size/alignment arithmetic), ``transition`` (the table), ``best_window``
(victim selection), ``RangeAllocator.rounded``. CrossHair cannot reach torch tensors, threads or
the sortedcontainers internals of the allocator's other methods; those are covered by the
stateful model tests instead (see CONTRIBUTING.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = [
    "embcache.core.allocator.align_up",
    "embcache.core.lifecycle.transition",
    "embcache.core.eviction.best_window",
]


@pytest.mark.crosshair
@pytest.mark.timeout(900)
def test_crosshair_finds_no_counterexample() -> None:
    budget = os.environ.get("EMBCACHE_CROSSHAIR_SECONDS", "15")
    result = subprocess.run(
        [sys.executable, "-m", "crosshair", "check", "--analysis_kind=PEP316",
         f"--per_condition_timeout={budget}", *TARGETS],
        cwd=ROOT, capture_output=True, text=True, timeout=840,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, result.stdout + result.stderr[-2000:]
