"""A real ``mooncake_master`` on loopback, for tests marked ``mooncake``.

``mooncake_master`` (session scope) is shared: tests keep apart by giving each store a unique
key prefix. ``private_mooncake_master`` (function scope) is for tests that kill or restart the
master. Both serve Mooncake's HTTP metadata from the master process itself, on free loopback
ports, and are stopped when the test ends, passed or failed. Without ``mooncake_master`` on
PATH the tests skip, or fail when ``CI`` is set.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_READY_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _serves_tcp(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def _serves_metadata(url: str) -> bool:
    """Whether the HTTP metadata server answers (404 for an unknown key counts)."""
    try:
        with urllib.request.urlopen(f"{url}?key=embcache-probe", timeout=0.5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class MooncakeMaster:
    """One ``mooncake_master`` process with its HTTP metadata server, on fixed loopback ports.

    ``kill`` (SIGKILL) and ``restart`` keep the ports, so clients configured with
    ``master_address`` and ``metadata_server`` find the new process. A restarted master has
    lost every object and every client registration (its state is in memory).
    """

    def __init__(self, binary: str, log_dir: Path) -> None:
        self.binary = binary
        self.log_path = log_dir / f"mooncake_master-{uuid.uuid4().hex[:8]}.log"
        self.rpc_port = _free_port()
        self.http_port = _free_port()
        self.metrics_port = _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """URL of the HTTP metadata server the master serves."""
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def store_kwargs(self) -> dict[str, str]:
        """Arguments that point a ``MooncakeStore`` at this master over loopback TCP."""
        return {
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
        }

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process and return once it serves RPC and metadata (bounded)."""
        assert not self.running, "master already running"
        command = [
            self.binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--rpc_thread_num=4",
        ]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not (_serves_tcp(self.rpc_port) and _serves_metadata(self.metadata_server)):
            if not self.running:
                raise RuntimeError(f"mooncake_master exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"mooncake_master not serving after {_READY_TIMEOUT_S} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the process (a crash: no cleanup) and reap it."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bound; idempotent."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=_STOP_TIMEOUT_S)
        self.kill()

    def restart(self) -> None:
        """Kill the process and start a new one on the same ports."""
        self.kill()
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        """The end of the master's log, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _master_binary() -> str:
    binary = shutil.which("mooncake_master")
    if binary is None:
        reason = (
            "mooncake_master is not on PATH: pip install 'embcache[mooncake]' "
            "(and apt-get install -y libibverbs1 librdmacm1 libnuma1)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def _running_master(log_dir: Path) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(_master_binary(), log_dir)
    try:
        master.start()
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A master shared by the session; never kill it (use ``private_mooncake_master``)."""
    yield from _running_master(tmp_path_factory.mktemp("mooncake"))


@pytest.fixture
def private_mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test alone, which it may kill and restart."""
    yield from _running_master(tmp_path)


@pytest.fixture
def key_prefix() -> str:
    """A key namespace of this test alone, so tests sharing a master never see each other."""
    return f"test-{uuid.uuid4().hex[:12]}/"
