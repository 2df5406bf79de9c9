"""Fleet claims on a real ``mooncake_master``: worker processes, one new image, one encode.

Each worker is a process (``tests.support.claim_worker``) with its own cache, pool and
``MooncakeStore`` lending no memory; the test process lends the store's memory (so a killed
worker loses nothing stored). The master's claim lease (``--put_start_discard_timeout_sec``) is
``LEASE_S``. Every worker checks its answer against the one right embedding of each key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embcache.store.mooncake import MooncakeStore
from embcache.store.mooncake_master import MooncakeMaster, find_master_binary
from tests.support import ports

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

LEASE_S = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test alone, with a short claim lease, and the store's memory."""
    pytest.importorskip("mooncake.store")
    with MooncakeMaster(find_master_binary(), tmp_path, ports.server_ports(3), LEASE_S) as m:
        lender = MooncakeStore(**m.store_kwargs(), global_segment_size=64 << 20)
        lender.connect()
        try:
            yield m
        finally:
            lender.close()


class Worker:
    """One worker process, ready to encode ``keys`` on ``go``."""

    def __init__(
        self, master: MooncakeMaster, keys: list[str], encode_s: float, *, claims: bool = True
    ) -> None:
        spec = {
            "store": {**master.store_kwargs(), "key_prefix": PREFIX},
            "keys": keys,
            "encode_s": encode_s,
            "lease_s": LEASE_S,
            "claims": claims,
        }
        env = {**os.environ, **MooncakeMaster.CLIENT_ENVIRONMENT, "MC_LOG_LEVEL": "ERROR"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.claim_worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )  # fmt: skip

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == word, f"worker said {line!r}, not {word!r} (exit {self.proc.poll()})"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        """Its JSON line (after any ``encoding`` lines)."""
        assert self.proc.stdout is not None
        while (line := self.proc.stdout.readline()).strip() == "encoding":
            self.encoding = True
        assert line, f"worker ended without an answer (exit {self.proc.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


PREFIX = f"claims-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """The test's workers; every one stopped at the end."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def start(
    master: MooncakeMaster,
    workers: list[Worker],
    n: int,
    keys: list[str],
    encode_s: float,
    **kw: Any,
) -> list[Worker]:
    new = [Worker(master, keys, encode_s, **kw) for _ in range(n)]
    workers += new
    for worker in new:  # (they start at once: a worker takes seconds to import and connect)
        worker.expect("ready")
    return new


def test_workers_given_one_new_image_at_once_encode_it_once(
    master: MooncakeMaster, workers: list[Worker]
) -> None:
    fleet = start(master, workers, 3, ["burst-a"], 0.5)
    for worker in fleet:
        worker.go()
    results = [w.result() for w in fleet]
    assert all(r["exact"] for r in results), results
    assert sum(r["encoded"] for r in results) == 1, results
    assert sum(r["claims"]["claimed"] for r in results) == 1
    assert sum(r["claims"]["loaded"] for r in results) == 2


def test_without_claims_the_same_fleet_encodes_it_once_per_worker(
    master: MooncakeMaster, workers: list[Worker]
) -> None:
    fleet = start(master, workers, 3, ["burst-b"], 0.5, claims=False)
    for worker in fleet:
        worker.go()
    results = [w.result() for w in fleet]
    assert all(r["exact"] for r in results)
    assert sum(r["encoded"] for r in results) == 3, "the duplicates claims remove"


def test_a_claimer_killed_mid_encode_leaves_the_image_to_the_others_after_the_lease(
    master: MooncakeMaster, workers: list[Worker]
) -> None:
    (claimer,) = start(master, workers, 1, ["killed"], 60.0)
    others = start(master, workers, 2, ["killed"], 0.3)
    claimer.go()
    claimer.expect("encoding")  # it holds the claim and is inside the encoder
    began = time.monotonic()
    for worker in others:
        worker.go()
    time.sleep(0.3)
    claimer.proc.kill()
    results = [w.result() for w in others]
    took = time.monotonic() - began
    assert all(r["exact"] for r in results), results
    assert sum(r["encoded"] for r in results) == 1, results
    assert sum(r["claims"]["taken_over"] for r in results) == 1
    assert sum(r["claims"]["loaded"] for r in results) == 1
    assert all(r["seconds"] <= LEASE_S + 1.0 + 1.5 for r in results), (took, results)


def test_with_the_master_killed_while_a_claim_is_live_every_request_is_answered(
    master: MooncakeMaster, workers: list[Worker]
) -> None:
    (claimer,) = start(master, workers, 1, ["no-master"], 1.5)
    others = start(master, workers, 2, ["no-master"], 0.2)
    claimer.go()
    claimer.expect("encoding")
    for worker in others:
        worker.go()
    time.sleep(0.3)
    master.kill()
    results = [w.result() for w in [claimer, *others]]
    assert all(r["exact"] for r in results), results
    assert results[0]["encoded"] == 1
    assert all(r["encoded"] == 1 for r in results[1:]), "no master: each encodes itself"
    assert sum(r["claims"]["unclaimed"] for r in results[1:]) == 2


def test_a_slow_claimer_publishing_after_its_lease_costs_a_counted_duplicate_never_wrong_bytes(
    master: MooncakeMaster, workers: list[Worker]
) -> None:
    (claimer,) = start(master, workers, 1, ["slow"], LEASE_S + 1.5)
    (other,) = start(master, workers, 1, ["slow"], 0.2)
    claimer.go()
    claimer.expect("encoding")
    other.go()
    late, early = claimer.result(), other.result()
    assert late["exact"] and early["exact"]
    assert late["encoded"] == early["encoded"] == 1, "the duplicate"
    assert early["claims"]["taken_over"] == 1
    assert late["claims"]["expired"] == 1, "the slow claimer counts its lost claim"
