"""The encode-server benchmark (``benchmarks/server/bench_server.py``) at a tiny size: its mixes are
what they say, every contender answers with the encoder's bytes, and a run gives a row per
contender and mix, JSON and a plot. Nothing here asserts a speed. The benchmark runs in a child
process (``python -m benchmarks.server.bench_server --size tiny``); the mixes are
``tests/support/server_workload.py``'s."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from embcache.driver.pool import copy_bytes
from tests.support import breakdown
from tests.support.server_workload import MAX_IMAGES, MIXES, TOKENS, make_encoder, make_workload

ROOT = Path(__file__).resolve().parents[1]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
SGLANG = "SGLang 0.5.23"


def bench_server(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.server.bench_server args`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.server.bench_server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def contenders(best_policy: str) -> set[str]:
    """Every contender's name, the best policy's included."""
    return {
        "no cache",
        SGLANG,
        "original PR in MMEncoder",
        "original PR direct",
        "embcache adapter lru",
        f"embcache adapter {best_policy}",
        f"embcache pipeline {best_policy}",
    }


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    torch.set_num_threads(1)
    return make_encoder(32)  # the tiny size's width


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny run of the verify, mixes (twice: medians), breakdown and scale parts: its JSON
    and plot."""
    out = tmp_path_factory.mktemp("server")
    command = ["--size", "tiny", "--parts", "verify", "mixes", "breakdown", "scale"]
    command += ["--repeats", "2"]
    command += ["--json", str(out / "r.json")]
    if HAS_MATPLOTLIB:
        command += ["--plot", str(out / "r.png")]
    done = bench_server(*command)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"result": json.loads((out / "r.json").read_text()), "out": out}


def test_requests_hold_distinct_images_and_the_mixes_differ(encoder: torch.nn.Module) -> None:
    work = make_workload(encoder, hot=40, requests=200, zipf_s=0.9, seed=3, mixes=MIXES)
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


def test_every_contender_answers_with_the_encoders_bytes(tiny_run: dict[str, Any]) -> None:
    """The verify part: a small steady mix served twice (the second pass hits) by every
    contender, each answer compared with the encoder's output, every contender closed after
    (embcache's check their invariants; a broken one fails the run)."""
    result = tiny_run["result"]
    verified, skipped = result["verify"]["contenders"], result["verify"]["skipped"]
    names = set(verified) | set(skipped)
    assert names == contenders(result["config"]["best_policy"]), names
    for name, counts in verified.items():
        assert counts["requests"] == 32 == counts["answered"] + counts["failed"], name
        assert counts["differ"] == 0 and counts["bad_times"] == 0, (name, counts)
        assert counts["failed_inserts"] >= 0
    failed = {name for name, counts in verified.items() if counts["failed"]}
    # SGLang's and the original PR's in MMEncoder's sequence: neither pins a hit between
    # has_local_embedding and the read, so the background insert can evict it first
    assert failed <= {SGLANG, "original PR in MMEncoder"}, failed
    saved = [n for n, c in verified.items() if n != "no cache" and c["read_bytes"] > 0]
    assert len(saved) == len(verified) - 1, "every cache served hits on the second pass"


def test_a_tiny_run_gives_every_row_json_and_a_plot(tiny_run: dict[str, Any]) -> None:
    result = tiny_run["result"]
    tiny = result["config"]
    everyone = contenders(tiny["best_policy"])
    measured = tiny["requests"] - tiny["requests"] // tiny["segments"]
    for mix in MIXES:
        rows = result["mixes"][mix]
        assert set(rows) | set(result["skipped"]) == everyone
        for name, row in rows.items():
            assert row["requests"] + row["failed_requests"] == measured, (mix, name)
            assert row["requests_per_s"] > 0 and row["p50_ms"] <= row["p99_ms"]
            assert 0 <= row["cache_share"] < 1
            assert 0 <= row["single_flight_share"] < 1
            if name.startswith("embcache"):
                assert row["failed_requests"] == 0, row["errors"]
        assert rows["no cache"]["encoder_tokens_saved"] == 0
        assert rows["no cache"]["bytes_copied"] == 0
    for name, rows in result["scale"].items():
        assert [r["pool_bytes"] for r in rows] == list(tiny["scale_pools"]), name
        entries = [r["entries"] for r in rows]
        assert entries == sorted(entries) and entries[0] < entries[-1], "bigger pools hold more"
        assert all(r["placeholders"] > 0 and r["requests"] > 0 for r in rows)
    assert result["machine"]["date"] and result["machine"]["build"] in ("compiled", "pure")
    assert len(result["repeats"]) == 2
    for mix, rows in result["mixes"].items():
        for name, row in rows.items():
            each = [run[mix][name]["requests_per_s"] for run in result["repeats"]]
            low, high = result["spread"][mix][name]["requests_per_s"]
            assert (low, high) == (min(each), max(each))
            assert row["requests_per_s"] == pytest.approx(sum(each) / 2), "the median of two"
        for name, target in result["targets"][mix].items():
            assert name.startswith("embcache")
            assert target["met"] == (
                target["vs_fastest_contender"] >= 1 and target["share_over_minimal_pts"] <= 3
            ), target
    table = result["headline"].splitlines()  # the README's table (--headline)
    assert len(table) == 2 + len(result["mixes"]["steady"])
    if HAS_MATPLOTLIB:
        assert (tiny_run["out"] / "r.png").stat().st_size > 0


def test_a_repeat_count_below_one_is_refused() -> None:
    done = bench_server("--size", "tiny", "--parts", "mixes", "--repeats", "0", timeout=120)
    assert done.returncode == 2 and "--repeats must be at least 1, not 0" in done.stderr


def test_the_seed_flag_seeds_the_workload(tmp_path: Path, encoder: torch.nn.Module) -> None:
    """``--seed N`` reaches the config and the workload: the run's hot set is seed N's."""
    done = bench_server(
        "--size", "tiny", "--parts", "mixes", "--mixes", "steady", "--seed", "2",
        "--json", str(tmp_path / "r.json"), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["seed"] == 2
    tiny = result["config"]

    def hot_bytes(seed: int) -> int:
        work = make_workload(
            encoder, tiny["hot"], tiny["requests"], tiny["zipf_s"], seed, mixes=("steady",)
        )
        return work.hot_bytes()

    assert result["hot_bytes"] == hot_bytes(2) != hot_bytes(0), "seed 2's catalog, not seed 0's"


def test_a_negative_seed_is_refused() -> None:
    done = bench_server("--size", "tiny", "--parts", "mixes", "--seed", "-1", timeout=120)
    assert done.returncode == 2 and "--seed must be at least 0, not -1" in done.stderr


def test_the_breakdown_splits_every_cache_time_and_scales_it(tiny_run: dict[str, Any]) -> None:
    result = tiny_run["result"]
    for mix in MIXES:
        rows = result["breakdown"][mix]
        assert set(rows) | set(result["skipped"]) == contenders(result["config"]["best_policy"]) - {
            "no cache"
        }
        for name, row in rows.items():
            assert set(row["shares"]) == set(breakdown.CATEGORIES)
            assert sum(row["shares"].values()) == pytest.approx(1.0), (mix, name)
            unprofiled = result["mixes"][mix][name]["cache_ms_per_request"]
            assert sum(row["ms"].values()) == pytest.approx(unprofiled), (mix, name)
            assert row["shares"]["core step"] > 0, (mix, name)


def test_the_breakdown_puts_each_kind_of_time_in_its_category() -> None:
    profiles = breakdown.Profiles()
    lock, cond = threading.Lock(), threading.Condition()
    big, into = torch.ones(1 << 24, dtype=torch.uint8), torch.empty(1 << 24, dtype=torch.uint8)
    with profiles.on():
        time.sleep(0.05)
        with cond:
            cond.wait(0.05)
        with profiles.off():
            time.sleep(0.2)  # the encoder's time: left out
        for _ in range(20):
            into.copy_(big)
        with lock:
            pass
    seconds = profiles.seconds()
    assert 0.04 < seconds["polling sleeps"] < 0.15, seconds
    assert 0.04 < seconds["single-flight waits"] < 0.15, seconds
    assert seconds["copies"] > 0, seconds
    total = sum(seconds.values())
    assert total < 0.15 + seconds["copies"] + 0.05, seconds


def test_the_breakdown_counts_embcaches_memmove_as_copies() -> None:
    """``copy_bytes`` copies through a ctypes foreign call, which cProfile does not see as a
    builtin: its time shows as ``copy_bytes``' own and must count as copies, not as driver
    Python (the pipeline's copies all go this way)."""
    profiles = breakdown.Profiles()
    src, dst = torch.ones(1 << 24, dtype=torch.uint8), torch.empty(1 << 24, dtype=torch.uint8)
    with profiles.on():
        for _ in range(20):
            copy_bytes(dst.data_ptr(), src.data_ptr(), src.nbytes)
    seconds = profiles.seconds()
    assert bool(torch.equal(dst, src))
    assert seconds["copies"] > 0.9 * sum(seconds.values()), seconds


def test_the_breakdown_counts_a_builtin_by_its_caller() -> None:
    core = ("/x/embcache/core/request_bodies.py", 1, "lookup_all")
    driver = ("/x/embcache/driver/runner.py", 1, "run")
    get = ("~", 0, "<method 'get' of 'dict' objects>")
    acquire = ("~", 0, "<method 'acquire' of '_thread.lock' objects>")
    wait = ("/usr/lib/python3.11/threading.py", 300, "wait")
    stats = {
        core: (1, 1, 1.0, 2.0, {}),
        driver: (1, 1, 2.0, 9.0, {}),
        get: (2, 2, 0.5, 0.5, {core: (1, 1, 0.3, 0.3), driver: (1, 1, 0.2, 0.2)}),
        acquire: (2, 2, 5.0, 5.0, {wait: (1, 1, 4.0, 4.0), driver: (1, 1, 1.0, 1.0)}),
        wait: (1, 1, 0.1, 4.1, {}),
    }
    seconds = breakdown.split(stats)
    assert seconds["core step"] == pytest.approx(1.3)
    assert seconds["driver Python"] == pytest.approx(2.2)
    assert seconds["single-flight waits"] == pytest.approx(4.1)
    assert seconds["lock waits"] == pytest.approx(1.0)


@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_a_fleet_on_one_mooncake_master_answers_exactly_and_claims_cut_duplicates(
    tmp_path: Path,
) -> None:
    """``--parts fleet``: W worker processes on one real master, each contender and mix: every
    request answered with its images' exact rows, the store used by all, and fleet claims
    encoding the burst mix's images no more often than the fleet without them."""
    out = tmp_path / "fleet.json"
    done = bench_server("--size", "tiny", "--parts", "fleet", "--json", str(out), timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["fleet"]["rows"]
    keyed = {(r["W"], r["contender"], r["mix"]): r for r in rows}
    assert {c for _, c, _ in keyed} == {"no claims", "claims", "hash routing"}
    for row in rows:
        assert row["wrong_answers"] == 0 and row["requests"] > 0, row
        assert row["store_mb"] > 0 and row["encodes"] >= row["distinct_images"] > 0, row
    for w, _, mix in keyed:
        claims, plain = keyed[w, "claims", mix], keyed[w, "no claims", mix]
        assert claims["claims"]["claimed"] > 0, claims
        if mix == "burst":
            assert claims["duplicate_encodes"] <= plain["duplicate_encodes"], (claims, plain)


def test_single_flight_waits_are_left_out_of_the_share_and_reported_beside() -> None:
    """The cache's share is (cache time - waits for another request's encode) / request time;
    the waits' own share sits beside it (bench_server's rows use this rule)."""
    share, joins = breakdown.cache_shares([0.2, 0.3], 0.3, [0.5, 0.5])
    assert share == pytest.approx((0.5 - 0.3) / 1.0) and joins == pytest.approx(0.3)
    assert breakdown.cache_shares([], 0.0, []) == (None, None)


def test_the_compiled_cores_steps_count_as_core_time() -> None:
    """Compiled, the core's steps are builtins to cProfile: they are core time, not their
    caller's (the driver's)."""
    step = ("~", 0, "<method 'begin_lookup' of 'CacheCore' objects>")
    query = ("~", 0, "<method 'stats' of 'StateQueries' objects>")
    driver = ("/x/embcache/driver/request.py", 1, "lookup")
    stats = {
        driver: (1, 1, 1.0, 4.0, {}),
        step: (1, 1, 2.0, 2.0, {driver: (1, 1, 2.0, 2.0)}),
        query: (1, 1, 1.0, 1.0, {driver: (1, 1, 1.0, 1.0)}),
    }
    seconds = breakdown.split(stats)
    assert seconds["core step"] == pytest.approx(3.0)
    assert seconds["driver Python"] == pytest.approx(1.0)
