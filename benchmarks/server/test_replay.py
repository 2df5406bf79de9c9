"""``benchmarks.server.replay``: the server benchmark's trace replayed in order through every
policy and the original PR's controller, each miss charged the encoder's cost for its size.

These import the benchmark, which no test under ``tests/`` may: ``tests/test_benchmarks.py``
runs this file with pytest in a child process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.server import replay
from tests.support.server_workload import make_encoder, make_workload


def test_every_contender_accounts_for_every_requested_token() -> None:
    report = replay.run("tiny", seed=0)
    assert set(report["costs"]) == {64, 144, 256, 576, 1024, 2304, 4096}
    assert all(seconds > 0 for seconds in report["costs"].values())
    for mix, rows in report["mixes"].items():
        assert set(rows) == {replay.ORIGINAL, *replay.CONTENDERS}, mix
        assert rows[replay.ORIGINAL]["vs_original_pr"] == pytest.approx(1.0)
        for name, row in rows.items():
            assert row["tokens_saved"] + row["tokens_encoded"] == row["requested_tokens"], name
            assert row["images"] > 0 and row["encoder_s"] > 0, (mix, name)


def test_with_room_for_everything_each_cache_encodes_each_image_once() -> None:
    """A pool that holds the whole catalog: every cache encodes exactly the first sight of
    each image, and the charge is the sum of those images' costs."""
    encoder = make_encoder(32)
    workload = make_workload(encoder, 24, 30, 0.9, 0, ("steady", "scan"))
    costs = {tokens: float(tokens) for tokens in (64, 144, 256, 576, 1024, 2304, 4096)}
    pool = 4 * sum(image.nbytes for images in workload.mixes["scan"] for image in images)
    for mix in ("steady", "scan"):
        trace = workload.mixes[mix]
        seen: set[str] = set()
        first = []
        for images in trace:
            for image in images:
                if image.key not in seen:
                    seen.add(image.key)
                    first.append(image)
        expected = sum(costs[image.tokens] for image in first)
        tallies = [replay.replay_original(trace, 0, pool, costs)] + [
            replay.replay_embcache(trace, 0, pool, costs, name) for name in replay.CONTENDERS
        ]
        for tally in tallies:
            assert (tally.images, tally.encoder_s) == (len(first), pytest.approx(expected)), mix


@pytest.mark.parametrize(
    ("flag", "message"),
    [("--seed=-1", "--seed must be at least 0, not -1"),
     ("--requests=0", "--requests must be at least 1, not 0")],
)  # fmt: skip
def test_bad_flags_are_refused(flag: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.server.replay", "--size", "tiny", flag],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and message in done.stderr


def test_one_mix_replays_the_same_trace_as_all_three() -> None:
    """The mixes draw from one generator: ``--mixes scan`` must still replay bench_server's
    scan trace, not one drawn without the other mixes."""
    alone, every = replay.run("tiny", 0, ["scan"]), replay.run("tiny", 0)
    assert set(alone["mixes"]) == {"scan"}
    for name, row in alone["mixes"]["scan"].items():
        if "work" in name:
            continue  # its decisions follow the measured costs, which vary run to run
        other = every["mixes"]["scan"][name]
        assert (row["tokens_saved"], row["images"]) == (other["tokens_saved"], other["images"])
