"""The main job in a small configuration: its own leak check, and numbers that add up.

Runs with the in-process store, with a real ``mooncake_master`` (marked ``mooncake``), and
with two tensor-parallel ranks; the command line's options, JSON, plot, progress bar, metrics
endpoint, one-line errors and exit codes; Mooncake's native log kept off stderr unless
``--verbose``; and that a ``mooncake_master`` the demo started is stopped when the demo is
terminated.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from embcache.__main__ import main
from embcache.core.build import loaded_build
from embcache.tools.demo import DemoConfig, DemoResult, Workload, run_demo, write_plot

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SMALL = DemoConfig(
    requests=60,
    catalogue=30,
    images_per_request=3,
    zipf=1.0,
    concurrency=3,
    pool_mib=0.1,  # a few dozen small embeddings: eviction on most inserts
    hidden=64,
    store_fault_rate=0.25,
    verify=True,
)
SMALL_ARGS = [
    "demo", "--requests", "30", "--catalogue", "20", "--images-per-request", "3",
    "--concurrency", "2", "--pool-mib", "0.1", "--hidden", "64",
]  # fmt: skip
REQUIRED_KEYS = {
    "requests", "requests_per_s", "local_hit_ratio", "global_hit_ratio", "encodes_saved",
    "fallbacks", "evictions", "p50_ms", "p99_ms", "leaks",
}  # fmt: skip


def assert_consistent(config: DemoConfig, out: dict[str, Any]) -> None:
    """The leak check passed and every number agrees with the others."""
    assert out["leaks"] == 0, out["leak_report"]
    assert out["errors"] == 0, out["error_samples"]
    assert out.keys() >= REQUIRED_KEYS
    workload = Workload.of(config)
    assert out["requests"] == config.requests
    assert out["images"] == sum(len(r) for r in workload.requests)
    served = out["local_hits"] + out["waited"]
    assert served + out["misses"] + out["fallbacks"] == out["images"], "hits + misses = lookups"
    assert out["fallbacks"] == sum(out["fallbacks_by_reason"].values())
    assert out["encodes_saved"] == out["images"] - out["encoded"]
    assert 0 < out["encoded"] <= out["misses"] + out["fallbacks"]
    assert out["encoded"] >= len({i for r in workload.requests for i in r}), "each once at least"
    loads = out["loads"]
    assert loads["started"] == loads["ok"] + loads["failed"] + loads["unknown"]
    assert out["global_hits"] == loads["ok"]
    publishes = out["publishes"]
    assert publishes["started"] == publishes["ok"] + publishes["failed"] + publishes["unknown"]
    assert out["local_hit_ratio"] == round(out["local_hits"] / out["images"], 4)
    assert out["global_hit_ratio"] == round(out["global_hits"] / out["images"], 4)
    assert out["evictions"] > 0, "the pool is meant to be too small"
    assert 0 < out["pool_occupancy"] <= 1
    assert 0 < out["p50_ms"] <= out["p99_ms"]
    assert out["requests_per_s"] > 0


def run(config: DemoConfig) -> dict[str, Any]:
    result = run_demo(config)
    out = result.to_json()
    json.dumps(out)
    summary = result.summary()
    assert "leak check        OK" in summary
    assert f"{out['encodes_saved']} encodes saved" in summary, "one name in JSON and summary"
    assert out["build"] == loaded_build(), "the report names the core's build that ran"
    assert f"\n  core build {loaded_build()}\n" in summary
    return out


def test_demo_default_has_no_global_tier() -> None:
    """The default demo keeps nothing outside its pool: no store read, no publish."""
    assert DemoConfig().store == "none"
    out = run(SMALL)
    assert_consistent(SMALL, out)
    assert out["verify_mismatches"] == 0
    assert out["loads"]["started"] == 0 and out["publishes"]["started"] == 0
    assert out["global_hits"] == 0 and out["injected_store_faults"] == 0


def test_demo_is_deterministic_in_its_workload() -> None:
    assert Workload.of(SMALL) == Workload.of(SMALL)
    assert Workload.of(SMALL) != Workload.of(replace(SMALL, seed=1))


@pytest.mark.mooncake
def test_demo_mooncake_store_small() -> None:
    pytest.importorskip("mooncake.store")
    if not _have_master():
        pytest.skip("mooncake_master is not on PATH")
    # lru: every fresh output enters the pool and is published, so what the small pool evicts
    # is in the store (a policy that refuses admission publishes nothing it refused)
    config = replace(SMALL, store="mooncake", segment_mib=64, policy="lru")
    out = run(config)
    assert_consistent(config, out)
    assert out["verify_mismatches"] == 0
    assert out["global_hits"] > 0, "evicted entries come back from the global store"
    # Every injected read failure is a failed load whose requests fell back and re-encoded.
    assert out["injected_store_faults"] > 0
    assert out["loads"]["failed"] == out["injected_store_faults"]
    assert out["fallbacks_by_reason"].get("load_failed", 0) >= out["injected_store_faults"]


def test_demo_tensor_parallel_two_ranks() -> None:
    config = replace(SMALL, requests=16, concurrency=2, tp=2, store_fault_rate=0.0)
    out = run(config)
    assert out["leaks"] == 0 and out["errors"] == 0
    assert out["verify_mismatches"] == 0


# ---------------------------------------------------------------------------- command line
def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "run.png"
    assert main([*SMALL_ARGS, "--json", "--quiet", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out.keys() >= REQUIRED_KEYS and out["leaks"] == 0 and out["requests"] == 30
    assert "encoder_calls_saved" not in out
    assert captured.err == "", "--quiet: no progress bar"
    assert png_size(plot.read_bytes()) == (1200, 650)


def test_cli_summary_and_no_progress_bar_off_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(SMALL_ARGS) == 0
    captured = capsys.readouterr()
    assert captured.err == "", "stderr is not a terminal here: no progress frames in logs"
    for line in ("throughput", "latency", "local hits", "global hits", "evictions", "pool"):
        assert line in captured.out
    assert "encodes saved" in captured.out
    assert "leak check        OK" in captured.out


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only() -> None:
    config = replace(SMALL, requests=20, verify=False)
    terminal, log = Terminal(), io.StringIO()
    run_demo(config, progress=terminal)
    run_demo(config, progress=log)
    assert "20/20" in terminal.getvalue() and "local hits" in terminal.getvalue()
    assert log.getvalue() == ""


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "requests to send (default: 400)" in text
    assert "--pool-mib POOL_MIB pool size in MiB (default: 8.0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import embcache

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"embcache {embcache.__version__}"


def test_an_unreachable_master_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mooncake.store")
    args = [*SMALL_ARGS, "--store", "mooncake", "--master", "127.0.0.1:1"]
    assert main(args) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert "127.0.0.1:1" in lines[0] and "refuses connections" in lines[0]
    assert captured.out == ""
    assert main([*args, "--verbose"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_metrics_endpoint_of_a_running_demo() -> None:
    """``--metrics-port 0``: the address on stderr, Prometheus text that parses, live counts."""
    parser = pytest.importorskip("prometheus_client.parser")
    demo = subprocess.Popen(
        [sys.executable, "-m", "embcache", *SMALL_ARGS, "--requests", "1000000",
         "--metrics-port", "0", "--policy", "lru"],  # lru: every insert call copies an output
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert demo.stderr is not None
        first = demo.stderr.readline()
        match = re.fullmatch(r"metrics: (http://127\.0\.0\.1:\d+/metrics)\n", first)
        assert match, first
        # The default demo has no global tier, so no store read to time (TimedStore's
        # histogram: tests/test_metrics.py); the insert histogram fills.
        inserts = "embcache_insert_seconds_count modality=image"
        wanted = ("embcache_hits_total", "embcache_inserts_total", "embcache_evictions_total")
        wanted += (inserts,)
        samples: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while not all(samples.get(name) for name in wanted):
            assert demo.poll() is None, "the demo ended early"
            assert time.monotonic() < deadline, f"not all of {wanted} yet: {samples}"
            time.sleep(0.2)
            samples = _scrape(parser, match.group(1))
        assert samples["embcache_capacity_bytes"] == 0.1 * (1 << 20) // 256 * 256
        assert samples["embcache_loads_started_total"] == 0, "no global tier: no store read"
        assert samples["embcache_inserts_total"] >= samples[inserts] > 0, "pipeline inserts timed"
        assert samples["embcache_fragmentation_ratio"] < 1
    finally:
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=30) == 128 + signal.SIGTERM


def _scrape(parser: Any, url: str) -> dict[str, float]:
    """``name [label=value ...]`` -> value of every sample of cache ``demo`` (no ``le``)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}  # not serving yet
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("cache", None) == "demo" and "le" not in labels:
                key = " ".join([sample.name, *(f"{k}={v}" for k, v in sorted(labels.items()))])
                samples[key] = sample.value
    return samples


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "required"),
        (["demo", "--requests", "0"], "--requests must be >= 1"),
        (["demo", "--concurrency", "-2"], "--concurrency must be >= 1"),
        (["demo", "--zipf", "-1"], "--zipf"),
        (["demo", "--zipf", "nan"], "--zipf"),
        (["demo", "--pool-mib", "0"], "--pool-mib"),
        (["demo", "--tp", "0"], "--tp must be >= 1"),
        (["demo", "--store", "redis"], "invalid choice"),
        (["demo", "--dtype", "int8"], "invalid choice"),
        (["demo", "--master", "127.0.0.1:1"], "need --store mooncake"),
        (["demo", "--store-fault-rate", "1"], "--store-fault-rate"),
        (["demo", "--prefetch-timeout", "0"], "--prefetch-timeout"),
        (["demo", "--plot", "out.txt"], "FILE.png"),
        (["demo", "--plot", "/no/such/dir/out.png"], "does not exist"),
        (["demo", "--requests", "many"], "invalid int value"),
        (["demo", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "embcache", *SMALL_ARGS, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["leaks"] == 0 and out["requests"] == 30


@pytest.mark.mooncake
def test_a_started_master_is_stopped_when_the_demo_is_terminated() -> None:
    if not _have_master():
        pytest.skip("mooncake_master is not on PATH")
    demo = subprocess.Popen(
        [sys.executable, "-m", "embcache", *SMALL_ARGS, "--store", "mooncake",
         "--segment-mib", "64", "--requests", "1000000"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    masters: list[int] = []
    try:
        assert demo.stderr is not None
        deadline = time.monotonic() + 60
        while not masters:  # wait for the master, then for requests to flow
            assert demo.poll() is None, "the demo ended early"
            assert time.monotonic() < deadline, "no mooncake_master started"
            masters = _children(demo.pid, "mooncake_master")
            time.sleep(0.05)
        time.sleep(1.0)  # let requests flow
        assert demo.poll() is None, demo.stderr.read1(4096)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=30) == 128 + signal.SIGTERM
        assert not any(_alive(pid) for pid in masters), "the master outlived the demo"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in masters:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_write_plot_of_an_empty_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_plot([], tmp_path / "empty.png")
    assert png_size((tmp_path / "empty.png").read_bytes()) == (1200, 650)


@pytest.mark.mooncake
def test_mooncake_native_log_only_with_verbose() -> None:
    """Quiet by default: no glog line on stderr; ``--verbose`` shows them, all on loopback."""
    if not _have_master():
        pytest.skip("mooncake_master is not on PATH")
    command = [sys.executable, "-m", "embcache", *SMALL_ARGS, "--store", "mooncake",
               "--segment-mib", "64", "--quiet"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "GLOG_"))}
    quiet = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90, check=False
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stderr == ""
    verbose = subprocess.run(
        [*command, "--verbose"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
        check=False,
    )  # fmt: skip
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    glog = [line for line in verbose.stderr.splitlines() if GLOG_LINE.match(line)]
    assert len(glog) > 10, verbose.stderr[-2000:]
    listening = [line for line in glog if "listening on" in line]
    assert listening and all("listening on 127.0.0.1:" in line for line in listening)


GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def test_summary_reports_a_leak() -> None:
    result = DemoResult(
        config=SMALL, requests=1, images=1, seconds=1.0, local_hits=0, waited=0,
        global_hits=0, single_flight_joins=0, encoded=1, encoder_batches=1, misses=1,
        fallbacks_by_reason={}, evictions=0, evicted_bytes=0, pool_bytes=1024,
        allocated_bytes=256, entries=1, fragmentation=0.0, loads={}, publishes={},
        injected_store_faults=0, p50_ms=1.0, p99_ms=1.0, errors=[],
        leak_report=["1 entries still pinned (256 bytes)"], verify_mismatches=None, build="pure",
    )  # fmt: skip
    assert result.to_json()["leaks"] == 1
    assert "leak check        FAILED: 1 entries still pinned" in result.summary()


# ---------------------------------------------------------------------------- helpers
def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, size = 8, (0, 0)
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        body = data[at + 4 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert zlib.crc32(body) == crc
        if body[:4] == b"IHDR":
            size = struct.unpack(">II", body[4:12])
        at += 12 + length
    return size


def _have_master() -> bool:
    from embcache.store.mooncake_master import master_binary

    return master_binary() is not None


def _children(parent: int, name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and comm == name:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
