"""``benchmarks/peers/bench_vllm.py`` runs both sides against their baselines on a tiny size: the
side-by-side run with vLLM's ECCPUConnector (whose replay must answer as the run did), the
``has_cache_item`` row and the worker's copy (what it measures is not judged)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.peers import bench_vllm as bench
from tests.integrations.vllm_fixtures import vllm_base

__all__ = ["vllm_base"]


def test_the_benchmark_measures_both_sides(vllm_base: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SCHEDULER_CHUNKS", {True: (2, 3)})
    rows = bench.scheduler_rows(quick=True)
    assert [r["unit"] for r in rows] == ["ns/item"]
    assert all(r["ours"] > 0 and r["baseline"] > 0 for r in rows)
    monkeypatch.setattr(bench, "SBS_POOL", 4 << 20)
    got = bench.side_by_side(40, 16, 1)  # replays check every answer against the run's
    ours, theirs = got["runs"]["embcache"][0], got["runs"]["eccpu"][0]
    assert ours.images == theirs.images > 40 and ours.missing == 0 and ours.errors == []
    assert ours.declared == ours.loaded > 0 and all(v[0] > 0 for v in got["cpu_us"].values())
    monkeypatch.setattr(bench, "POOL_BYTES", 1 << 20)
    ours, raw = bench._load_rates(256 * 1024, True, torch.device("cpu"))
    assert ours > 0 and raw > 0


def test_callgrind_totals_are_read_from_each_dump_in_order(tmp_path: Any) -> None:
    out = tmp_path / "cg.out"
    for n, total in ((1, 1234), (2, 56)):
        (tmp_path / f"cg.out.{n}").write_text(f"events: Ir\nsummary: {total}\ntotals: {total}\n")
    assert bench.dump_totals(out) == [1234, 56]
