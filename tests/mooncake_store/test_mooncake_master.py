"""``MooncakeMaster`` starts only a master that serves on its own ports.

A CI run once started a master whose RPC port was answered by another listener: the start
returned, the master exited a second later, and every client call of the test failed with
``RPC call failed: End of file``. These tests pin the two guards against that.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from embcache.errors import StoreUnavailableError
from embcache.store.mooncake_master import MooncakeMaster, listens

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]


def test_a_masters_ports_are_distinct_and_free() -> None:
    for _ in range(32):  # not started: the ports are chosen by the constructor
        master = MooncakeMaster(binary="mooncake_master")
        ports = [master.rpc_port, master.http_port, master.metrics_port]
        assert len(set(ports)) == len(ports)
        for port in ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        master.stop()


def test_a_started_master_listens_on_its_own_rpc_and_metadata_ports(tmp_path: Path) -> None:
    with MooncakeMaster(log_dir=tmp_path) as master:
        pid = master.pid
        assert pid is not None
        assert len({master.rpc_port, master.http_port, master.metrics_port}) == 3
        assert listens(pid, master.rpc_port)
        assert listens(pid, master.http_port)
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            assert not listens(pid, other.getsockname()[1]), "another process's listener"
    assert master.pid is None, "no process after stop"


def test_start_refuses_a_master_whose_rpc_port_another_process_holds(tmp_path: Path) -> None:
    master = MooncakeMaster(log_dir=tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        master.rpc_port = squatter.getsockname()[1]  # connections to it succeed, but not ours
        try:
            with pytest.raises(StoreUnavailableError, match="mooncake_master"):
                master.start()
        finally:
            master.stop()
    assert not master.running


def test_without_proc_any_loopback_listener_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    real_listdir = os.listdir

    def no_proc(path: str) -> list[str]:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", no_proc)  # /proc made unreadable
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert listens(1, port), "whoever listens counts without /proc"
    assert not listens(1, port), "nobody listens any more"
