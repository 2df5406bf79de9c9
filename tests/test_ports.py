"""``tests/support/ports.py``: each session's block of ports is its own, its server ports bind,
Mooncake's clients are kept inside it, and process groups meet through a file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ports

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
