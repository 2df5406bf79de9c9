"""``bench_instructions --bytecodes``: what the interpreter runs per operation of each side,
counted exactly (bytecodes, Python calls, C calls), run as the benchmark's own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import sglang_wheel
from tests.support.rows import check_row

ROOT = Path(__file__).resolve().parents[1]


def test_bytecode_counts_are_exact_and_name_every_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers.bench_instructions", "--bytecodes", "--tiny",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())
    for row in rows:
        check_row(row)
    names = [row["name"] for row in rows]
    for what in (
        "8-item all-hit request",
        "8-item all-hit in two steps",
        "evicting insert in a request",
        "evicting cache.insert",
    ):
        for unit in ("bytecodes", "python calls", "C calls"):
            assert sum(name.startswith(f"{unit}, {what}") for name in names) == 1, (unit, what)
    try:
        sglang_wheel.load_controller_module()
    except sglang_wheel.SGLangUnavailable:
        return  # the rows are skipped, with the reason
    for row in rows:
        # Counted, not timed: every op of a side runs the same code, so a count per op is a
        # whole number (a fraction would mean ops differ, or the counting's own calls leak in).
        assert row["ours"] > 0 and row["ours"] == int(row["ours"]), row
        assert row["baseline"] > 0 and row["baseline"] == int(row["baseline"]), row
    inserts = {row["name"].split(",")[0]: row for row in rows if "cache.insert" in row["name"]}
    assert inserts["bytecodes"]["ours"] > inserts["python calls"]["ours"] > 1
