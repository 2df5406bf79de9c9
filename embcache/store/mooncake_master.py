"""A local ``mooncake_master`` on free loopback ports, for the demo and the Mooncake tests.

``MooncakeMaster`` starts the binary with its own HTTP metadata server (so no etcd is needed),
waits until both serve, and stops it (SIGTERM, then SIGKILL after a bound). ``kill`` and
``restart`` keep the ports, so clients configured with ``store_kwargs()`` find a restarted
master. A master's state is in memory: a restarted one has lost every object.

This is the launching code of the tests' master fixtures (``tests/conftest.py``) moved into the
package so the demo (``python -m embcache demo --store mooncake``) can use it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import ClassVar

from embcache.errors import InvalidArgumentError, StoreUnavailableError
from embcache.store.mooncake_config import reachable

__all__ = ["MooncakeMaster", "find_master_binary", "listens", "master_binary"]

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0


def master_binary() -> str | None:
    """The path of ``mooncake_master``: on ``PATH``, else next to this interpreter's scripts
    (a virtual environment used without activating it); None when neither has it."""
    return shutil.which("mooncake_master") or shutil.which(
        "mooncake_master", path=sysconfig.get_path("scripts")
    )


def find_master_binary() -> str:
    """The path of ``mooncake_master``; ``StoreUnavailableError`` saying how to install it."""
    binary = master_binary()
    if binary is None:
        raise StoreUnavailableError(
            "mooncake_master is not on PATH: pip install 'embcache[mooncake]' "
            "(and apt-get install -y libibverbs1 librdmacm1 libnuma1)"
        )
    return binary


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports: every socket stays bound until all are chosen,
    so the kernel cannot hand out one port twice. (Given one port for two of its servers, the
    master logs that both started, keeps running, and its RPC port answers HTTP: every client
    call then ends in ``RPC call failed: End of file``.)"""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` has open (``OSError`` without ``/proc``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed since the listing
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself has a listening TCP socket on ``port`` (what ``start``
    waits for: a port that answers may be another process's).

    On Linux from ``/proc`` (a socket of the process, in state LISTEN, on that port); without
    ``/proc``, whether a loopback connection succeeds (whoever listens).
    """
    try:
        inodes = _socket_inodes(pid)
        tables = [Path(f"/proc/{pid}/net/{name}").read_text() for name in ("tcp", "tcp6")]
    except OSError:
        return reachable(("127.0.0.1", port), 0.2)
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "0A" and fields[9] in inodes:
                return True
    return False


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
    """One ``mooncake_master`` process with its HTTP metadata server on loopback.

    ``binary`` defaults to ``find_master_binary()``; the log goes to ``log_dir`` (default: a
    temporary directory removed by ``stop``); ``ports`` are its RPC, metadata and metrics ports
    (default: three that are free now; a caller sharing the machine with other runs gives ports
    it holds, as the tests do from ``tests/support/ports.py``). ``claim_lease_s`` sets the
    master's ``--put_start_discard_timeout_sec`` (default 30 s): how long a started, unended put
    keeps its key from other creators, which is the lease of a claim (``embcache.pipeline.claims``).
    As a context manager it starts and stops.

    The master's RPC service, metadata server and metrics are given 127.0.0.1 (Mooncake
    0.3.13's metadata server still binds every interface). A client process should also have
    ``CLIENT_ENVIRONMENT`` set before it connects, so its transfer engine advertises loopback
    instead of the first LAN address it finds (it still listens on every interface).
    """

    #: Environment for a client process of a loopback master (read at each client setup).
    CLIENT_ENVIRONMENT: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    )

    def __init__(
        self,
        binary: str | None = None,
        log_dir: Path | None = None,
        ports: Sequence[int] | None = None,
        claim_lease_s: int | None = None,
    ) -> None:
        if claim_lease_s is not None and (isinstance(claim_lease_s, bool) or claim_lease_s < 1):
            raise InvalidArgumentError(
                f"claim_lease_s must be whole seconds >= 1, got {claim_lease_s!r}"
            )
        self.claim_lease_s = claim_lease_s
        self.binary = binary or find_master_binary()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="embcache-mooncake-")
            log_dir = Path(self._tmp.name)
        self.log_path = log_dir / f"mooncake_master-{uuid.uuid4().hex[:8]}.log"
        chosen = _free_ports(3) if ports is None else list(ports)
        if len(set(chosen)) != 3:
            raise InvalidArgumentError(f"ports must be 3 distinct ports, got {ports!r}")
        self.rpc_port, self.http_port, self.metrics_port = chosen
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
    def pid(self) -> int | None:
        """The process id of the master started last, None before ``start`` and after
        ``kill``/``stop``."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process; return once it listens on its RPC port and serves metadata
        (at most 20 s)."""
        if self.running:
            raise StoreUnavailableError("mooncake_master is already running")
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
        if self.claim_lease_s is not None:
            command.append(f"--put_start_discard_timeout_sec={self.claim_lease_s}")
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        pid = self._process.pid
        while not (listens(pid, self.rpc_port) and _serves_metadata(self.metadata_server)):
            if not self.running:
                raise StoreUnavailableError(f"mooncake_master exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.kill()
                raise StoreUnavailableError(
                    f"mooncake_master not serving after {READY_TIMEOUT_S} s:\n{tail}"
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
        """SIGTERM, then SIGKILL after 5 s; remove a temporary log directory. Idempotent."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=STOP_TIMEOUT_S)
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

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

    def __enter__(self) -> MooncakeMaster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
