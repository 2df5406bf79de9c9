"""``benchmarks/bench_vllm.py`` runs both sides against their baselines on a tiny size and
leaves the scheduler with only its holder request open (what it measures is not judged)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks import bench_vllm as bench
from tests.integrations.vllm_fixtures import vllm_base

__all__ = ["vllm_base"]


def test_the_benchmark_measures_both_sides(vllm_base: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SCHEDULER_CHUNKS", {True: (2, 3)})
    rows = bench.scheduler_rows(quick=True)  # asserts the measured requests all closed
    assert [r["unit"] for r in rows] == ["ns/item", "ns/item"]
    assert all(r["ours"] > 0 and r["baseline"] > 0 for r in rows)
    monkeypatch.setattr(bench, "POOL_BYTES", 1 << 20)
    ours, raw = bench._load_rates(256 * 1024, True, torch.device("cpu"))
    assert ours > 0 and raw > 0


def test_callgrind_totals_are_read_from_each_dump_in_order(tmp_path: Any) -> None:
    out = tmp_path / "cg.out"
    for n, total in ((1, 1234), (2, 56)):
        (tmp_path / f"cg.out.{n}").write_text(f"events: Ir\nsummary: {total}\ntotals: {total}\n")
    assert bench.dump_totals(out) == [1234, 56]
