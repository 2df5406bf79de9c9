"""What tests that share a machine use (``tests/support/ports.py``, ``processes.py``): each
session's block of ports is its own, its server ports bind, Mooncake's clients are kept inside
it, process groups meet through a file, and spawned ranks are never left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ports
from tests.support.processes import spawned_ranks

ROOT = Path(__file__).resolve().parents[1]


def other_process_block() -> int:
    """The first port of the block another process leases while this one holds its own."""
    code = "from tests.support import ports; print(ports.lease().first)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(out.stdout.strip())


def test_another_session_leases_another_block() -> None:
    mine = ports.lease()  # leased by this session's conftest already
    others = {other_process_block() for _ in range(3)}  # each exits, dropping its lock
    assert mine.first not in others
    assert all(ports.FIRST <= first < ports.FIRST + ports.BLOCKS * ports.BLOCK for first in others)


def test_server_ports_are_distinct_in_the_block_and_bind() -> None:
    block = ports.lease()
    got = ports.server_ports(3) + ports.server_ports(3)
    assert len(set(got)) == 6
    assert all(block.first <= p < block.first + ports.SERVER_PORTS for p in got)
    with socket.socket() as held:
        held.bind(("127.0.0.1", got[0]))
        held.listen()
        for _ in range(ports.SERVER_PORTS):  # a full turn: the held port is skipped
            assert got[0] not in ports.server_ports(1)


def test_mooncake_clients_are_kept_in_the_block() -> None:
    block, env = ports.lease(), ports.environment()
    assert {k: os.environ[k] for k in env} == env  # set for the session by tests/conftest.py
    bounds = [int(env[k]) for k in sorted(env)]
    assert all(block.first + ports.SERVER_PORTS <= p < block.first + ports.BLOCK for p in bounds)
    assert int(env["MC_STORE_CLIENT_MAX_PORT"]) < int(env["MC_MIN_RPC_PORT"])
    assert block.first + ports.BLOCK <= 32767  # Mooncake takes client ports up to 32767


def test_a_rendezvous_is_a_fresh_file(tmp_path: Path) -> None:
    assert ports.rendezvous(tmp_path) == f"file://{tmp_path}/rendezvous"
    (tmp_path / "rendezvous").touch()
    with pytest.raises(FileExistsError):
        ports.rendezvous(tmp_path)


def _rank(rank: int, behaviour: str) -> None:
    """A rank of ``spawned_ranks``' test: rank 1 hangs or dies as told, rank 0 ends."""
    if rank == 1 and behaviour == "hang":
        time.sleep(600)
    if rank == 1 and behaviour == "die":
        os._exit(3)


@pytest.mark.stress  # spawned ranks import torch: about 15 s each on a loaded machine
@pytest.mark.parametrize("behaviour", ["end", "hang", "die"])
def test_spawned_ranks_are_never_left_behind(behaviour: str) -> None:
    deadline = 20.0 if behaviour == "hang" else 240.0  # a spawned rank imports torch: seconds
    started = time.monotonic()
    ended = spawned_ranks(_rank, (behaviour,), 2, deadline_s=deadline)
    if behaviour == "end":
        assert ended.in_time and ended.exit_codes == [0, 0]
    elif behaviour == "hang":  # killed at the deadline, and reaped
        assert not ended.in_time and ended.exit_codes[1] == -signal.SIGKILL
    else:
        assert ended.in_time and ended.exit_codes[1] == 3  # torch ends the others then
        assert ended.exit_codes[0] in (0, -signal.SIGTERM)
    assert time.monotonic() - started < deadline + 30
