"""``benchmarks/peers/bench_sglang_adapter.py`` runs its sequence on both controllers and leaves our
cache idle (its ``--tiny`` size in a child process; what it measures is not judged here). That it
waits for SGLang's PUTs on SGLang's own signal, not on time, is checked beside it
(``benchmarks/peers/test_bench_sglang_adapter.py``, run by ``tests/test_benchmarks.py``): the
check replaces a method of the benchmark, which no test here may import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.rows import check_row
from tests.support.sglang_wheel import SGLangUnavailable, load_controller_module

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_both_controllers_through_the_sequence(tmp_path: Path) -> None:
    try:
        load_controller_module()
    except SGLangUnavailable as exc:
        pytest.skip(f"sglang 0.5.23's wheel cannot be had here: {exc}")
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.peers.bench_sglang_adapter", "--tiny"]
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    # a non-zero status: the run raised, e.g. its check that our cache ends idle, with
    # nothing pinned, having evicted, its invariants holding
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())
    for row in rows:
        check_row(row)
    # ours against SGLang's, per item of a hit and of a miss request: all four times measured
    names = [row["name"] for row in rows]
    assert names == [f"MMEncoder {kind} request, tiny, vs SGLang" for kind in ("hit", "miss")]
    assert all(row["ours"] > 0 and row["baseline"] > 0 for row in rows)

