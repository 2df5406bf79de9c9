"""``MooncakeMaster`` starts only a master that serves on its own ports.

A CI run once started a master whose RPC port was answered by another listener: the start
returned, the master exited a second later, and every client call of the test failed with
``RPC call failed: End of file``. These tests pin the two guards against that.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from embcache.errors import StoreUnavailableError

# private: the two guards these tests pin are the module's own helpers
from embcache.store.mooncake_master import MooncakeMaster, _free_ports, _listens

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]


def test_free_ports_are_distinct_and_free() -> None:
    ports = _free_ports(64)
    assert len(set(ports)) == len(ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_started_master_listens_on_its_own_rpc_and_metadata_ports(tmp_path: Path) -> None:
    with MooncakeMaster(log_dir=tmp_path) as master:
        # private: the master's process id (MooncakeMaster has no public one)
        assert master._process is not None
        pid = master._process.pid  # private: as above
        assert len({master.rpc_port, master.http_port, master.metrics_port}) == 3
        assert _listens(pid, master.rpc_port)
        assert _listens(pid, master.http_port)
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            assert not _listens(pid, other.getsockname()[1]), "another process's listener"


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
    import embcache.store.mooncake_master as mm

    def no_proc(pid: int) -> set[str]:
        raise FileNotFoundError(f"/proc/{pid}/fd")

    monkeypatch.setattr(mm, "_socket_inodes", no_proc)  # private: /proc made unreadable
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert _listens(1, port), "whoever listens counts without /proc"
    assert not _listens(1, port), "nobody listens any more"
