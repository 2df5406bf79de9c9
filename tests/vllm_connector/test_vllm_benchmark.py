"""``benchmarks/peers/bench_vllm.py`` runs both sides against their baselines on its ``--tiny``
size, in a child process: the side-by-side run with vLLM's ECCPUConnector (whose replay must
answer as the run did), the ``has_cache_item`` row and the worker's copy (what it measures is
not judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ports
from tests.support.callgrind import dump_totals
from tests.support.rows import check_row

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_measures_both_sides(vllm_base: Any, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.peers.bench_vllm", "--tiny", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # non-zero: the run raised (a replay answered otherwise than the run, or ours ended with a
    # request open or an invariant broken)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())
    for row in rows:
        check_row(row)
    by_name = {row["name"]: row for row in rows}
    assert len(by_name) == len(rows)
    scheduler = by_name["vllm scheduler: has_cache_item"]
    bare = by_name["vllm scheduler: has_cache_item vs a bare C call"]
    floor = by_name["floor: a bare C call vs key in dict"]
    for row in (scheduler, bare, floor):
        assert row["unit"] == "ns/item" and row["ours"] > 0 and row["baseline"] > 0
    # one measurement each: ours, the dict lookup, the bare call
    assert (bare["ours"], bare["baseline"]) == (scheduler["ours"], floor["ours"])
    assert floor["baseline"] == scheduler["baseline"]

    def side_of(row: dict[str, Any]) -> tuple[float, float]:  # (ours, ECCPUConnector's)
        return row["ours"], row["baseline"]

    def side(name: str) -> tuple[float, float]:
        return side_of(by_name[f"vllm vs ECCPUConnector: {name}"])

    images, errors = side("images"), side("engine errors")
    assert images[0] == images[1] > 40 and side("declared, missing")[0] == 0 and errors[0] == 0
    assert side("declared present")[0] == side("loaded")[0] > 0
    assert all(v > 0 for v in side("scheduler CPU/image"))
    for share in ("2", "1", "0.5", "0.25"):  # the pool sweep: ours declared nothing missing
        prefix = f"vllm pool {share}x working set:"
        assert by_name[f"{prefix} declared, missing vs ECCPUConnector"]["ours"] == 0
        cpu = by_name[f"{prefix} scheduler CPU/image vs ECCPUConnector"]
        assert all(v > 0 for v in side_of(cpu))
        assert 0 < by_name[f"{prefix} not encoded vs ideal LRU"]["baseline"] < 1
    (load,) = [r for r in rows if r["name"].startswith("vllm worker: load 0.25 MB items to ")]
    assert load["ours"] > 0 and load["baseline"] > 0


def test_the_benchmarks_pools_flag_runs_the_pool_sweep_alone(
    vllm_base: Any, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.peers.bench_vllm", "--tiny", "--pools"]
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    names = [row["name"] for row in json.loads(out.read_text())]
    shares = {name.split("x working set:")[0] for name in names}
    assert shares == {f"vllm pool {share}" for share in ("2", "1", "0.5", "0.25")}
    for share in ("2", "1", "0.5", "0.25"):
        assert f"vllm pool {share}x working set: scheduler CPU/image vs ECCPUConnector" in names


def test_callgrind_totals_are_read_from_each_dump_in_order(tmp_path: Any) -> None:
    out = tmp_path / "cg.out"
    for n, total in ((1, 1234), (2, 56)):
        (tmp_path / f"cg.out.{n}").write_text(f"events: Ir\nsummary: {total}\ntotals: {total}\n")
    assert dump_totals(out) == [1234, 56]


# -- benchmarks/peers/vllm_engines.py: its trace and its bad inputs (no engine needed) ----------
def test_the_engine_benchmarks_trace_is_zipf_over_the_catalog_with_1_to_4_images() -> None:
    from collections import Counter

    from tests.support.vllm_engines import FULL, trace

    prompts = trace(FULL)
    assert prompts == trace(FULL) and len(prompts) == FULL.requests
    catalog = range(1000, 1000 + FULL.catalog)
    for p in prompts:
        assert 1 <= len(p["images"]) <= 4 and len(set(p["images"])) == len(p["images"])
        assert set(p["images"]) <= set(catalog) and len(p["words"]) == 3
    seen = Counter(i for p in prompts for i in p["images"])
    assert seen[1000] > seen[1001] > seen[1000 + FULL.catalog // 2], seen.most_common(3)
    assert sum(seen.values()) > len(seen) * 2  # images repeat


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"contenders": ("none", "eccpu", "lmcache")}, "unknown contender"),
        ({"contenders": ("embcache-pool",)}, "must include 'none'"),
        ({"pools": ("fits", "half")}, "unknown pool size"),
        ({"catalog": 3}, "smaller than one image"),
        ({"requests": 0}, "requests must be"),
        ({"master": "127.0.0.1:{port}"}, "nothing answers there"),
        ({"master": "localhost"}, "pass 'host:port'"),
    ],
)
def test_the_engine_benchmark_refuses_bad_input_before_it_starts_anything(
    change: dict[str, Any], says: str, tmp_path: Path
) -> None:
    from dataclasses import asdict

    from embcache.errors import InvalidArgumentError
    from tests.support import vllm_engines

    if "master" in change:
        free = ports.server_ports(1)[0]  # a port of this session's block where nothing listens
        change = {"master": change["master"].format(port=free)}
    config = vllm_engines.Config(**{**asdict(vllm_engines.QUICK), **change})
    proof = tmp_path / "proof"
    with pytest.raises(InvalidArgumentError, match=says):
        vllm_engines.run(config, "/nonexistent/python", proof)  # an engine would fail otherwise
    assert not proof.exists() and list(tmp_path.iterdir()) == []


def test_the_engine_benchmarks_command_line_refuses_an_unknown_contender(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.peers.vllm_engines", "--quick",
               "--contenders", "none,nope", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "InvalidArgumentError: unknown contender(s) ['nope']" in (
        done.stderr
    ), done.stderr[-2000:]
    assert not out.exists()
