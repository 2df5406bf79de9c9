"""The encode-server benchmark (``benchmarks/server/bench_server.py``) at a tiny size: its mixes are
what they say, every contender answers with the encoder's bytes, and a run gives a row per
contender and mix, JSON and a plot. Nothing here asserts a speed."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from benchmarks.server import bench_server
from benchmarks.server.contenders import Lane
from benchmarks.server.fleet import run_fleet
from benchmarks.server.workload import MAX_IMAGES, TOKENS, make_encoder, make_workload

TINY = bench_server.SIZES["tiny"]
CONTENDERS = set(bench_server.contender_names(TINY.best_policy))
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    torch.set_num_threads(1)
    return make_encoder(TINY.hidden)


def test_requests_hold_distinct_images_and_the_mixes_differ(encoder: torch.nn.Module) -> None:
    work = make_workload(
        encoder, hot=40, requests=200, zipf_s=0.9, seed=3, mixes=bench_server.MIXES
    )
    hot = {id(i) for i in work.images[: work.hot]}
    assert {i.tokens for i in work.images} <= set(TOKENS)
    for requests in work.mixes.values():
        assert len(requests) == 200
        assert all(
            1 <= len(r) <= MAX_IMAGES and len({i.key for i in r}) == len(r) for r in requests
        )
    assert all(id(i) in hot for r in work.mixes["steady"] for i in r)
    scanned = Counter(i.key for r in work.mixes["scan"] for i in r if id(i) not in hot)
    assert scanned and set(scanned.values()) == {1}, "scan images are seen once"
    early = Counter(i.key for r in work.mixes["drifting"][:50] for i in r)
    late = Counter(i.key for r in work.mixes["drifting"][-50:] for i in r)
    top = [k for k, _ in early.most_common(5)]
    assert sum(late[k] for k in top) < sum(early[k] for k in top) / 2, "the hot set moved"


def test_every_contender_answers_with_the_encoders_bytes(encoder: torch.nn.Module) -> None:
    work = make_workload(encoder, hot=12, requests=16, zipf_s=0.9, seed=1, mixes=("steady",))
    pool = int(0.5 * work.hot_bytes())
    contenders, skipped = bench_server.make_contenders(
        encoder, pool, TINY.best_policy, TINY.sglang_page_bytes
    )
    names = {c.name for c in contenders} | set(skipped)
    assert names == CONTENDERS, names
    lane = Lane()
    failed: Counter[str] = Counter()
    try:
        for contender in contenders:
            for n, images in enumerate(work.mixes["steady"] * 2):  # the second pass hits
                try:
                    served = contender.serve(f"r{n}", images, lane)
                except RuntimeError as exc:  # SGLang's: a hit evicted before its read
                    assert "not available" in str(exc)
                    failed[contender.name] += 1
                    continue
                expected = torch.cat(encoder([i.pixels for i in images]))
                assert torch.equal(served.embeddings, expected), contender.name
                assert 0 <= served.cache_seconds <= served.seconds
            contender.finish()
            assert contender.failed_inserts() >= 0
    finally:
        lane.close()
        for contender in contenders:
            contender.close()  # embcache's check their invariants
    assert set(failed) <= {bench_server.SGLANG}, failed
    saved = [c for c in contenders if c.name != "no cache" and c.counts["read_bytes"] > 0]
    assert len(saved) == len(contenders) - 1, "every cache served hits on the second pass"


def test_a_tiny_run_gives_every_row_json_and_a_plot(tmp_path: Path) -> None:
    code = bench_server.main(
        ["--size", "tiny", "--parts", "mixes", "scale", "--json", str(tmp_path / "r.json")]
        + (["--plot", str(tmp_path / "r.png")] if HAS_MATPLOTLIB else [])
    )
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    measured = TINY.requests - TINY.requests // TINY.segments
    for mix in bench_server.MIXES:
        rows = result["mixes"][mix]
        assert set(rows) | set(result["skipped"]) == CONTENDERS
        for name, row in rows.items():
            assert row["requests"] + row["failed_requests"] == measured, (mix, name)
            assert row["requests_per_s"] > 0 and row["p50_ms"] <= row["p99_ms"]
            assert 0 <= row["cache_share"] < 1
            if name.startswith("embcache"):
                assert row["failed_requests"] == 0, row["errors"]
        assert rows["no cache"]["encoder_tokens_saved"] == 0
        assert rows["no cache"]["bytes_copied"] == 0
    for name, rows in result["scale"].items():
        assert [r["pool_bytes"] for r in rows] == list(TINY.scale_pools), name
        entries = [r["entries"] for r in rows]
        assert entries == sorted(entries) and entries[0] < entries[-1], "bigger pools hold more"
        assert all(r["placeholders"] > 0 and r["requests"] > 0 for r in rows)
    assert result["machine"]["date"]
    table = bench_server.headline(result).splitlines()
    assert len(table) == 2 + len(result["mixes"]["steady"])
    if HAS_MATPLOTLIB:
        assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_two_server_processes_share_one_mooncake_master() -> None:
    result = run_fleet(TINY)
    alone, shared = result["rows"]["alone"], result["rows"]["one mooncake_master"]
    for row in (alone, shared):
        assert row["requests"] == TINY.requests and row["publishes_failed"] == 0
    assert alone["global_hits"] == 0
    assert shared["global_hits"] > 0 and shared["loads_failed"] == 0, shared
    assert set(result["skipped"]) == {"original PR", "SGLang 0.5.23"}
