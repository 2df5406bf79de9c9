"""Ports for the servers tests start, so that two runs of the suite on one machine never collide.

A port found free by binding it and letting it go (``bind(("127.0.0.1", 0))``) is free only
for that moment: until the server binds it, any other process may take it, and every
``connect`` on the machine draws its local port from the same (ephemeral) range. Two runs of the
Mooncake tier at once start dozens of masters and clients each, and Mooncake's clients pick
their own ports at random in one fixed range (12300-14300), the same in every process.

So each test session leases a block of ``BLOCK`` loopback ports of its own (``lease``): it
holds an exclusive ``flock`` on one file per block under the temporary directory for as long as
it runs (the kernel drops the lock when the process ends, however it ends), and the blocks lie
below the ephemeral range (Linux: from 32768), where no ``connect`` and no ``bind`` to port 0
lands. In its block a session gives:

- ``server_ports(n)``: ports for the servers its tests start (a ``mooncake_master``'s RPC,
  metadata and metrics ports), in turn through the first ``SERVER_PORTS`` of the block, each
  checked free by a bind first (a port of an earlier master of this session may linger);
- ``environment()``: the ranges Mooncake's clients draw their own ports from at random
  (``MC_STORE_CLIENT_MIN_PORT``/``MC_STORE_CLIENT_MAX_PORT``, default 12300-14300; the transfer
  engine's ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``, default 15000-17000), set by
  ``tests/conftest.py`` for the session and every process it starts.

Process groups of ``torch.distributed`` meet through a file (``rendezvous``), not a port.
vLLM's engines pick their own ports by binding port 0 (``get_open_port``): left as they are, as
``VLLM_PORT`` would make engines started together count up from one port and collide. Names in
shared memory need no lease: the vLLM pool is a ``memfd`` (no name), and Mooncake's clients
here map no shared segment by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

FIRST = 20000  # the first block's first port
BLOCK = 400  # ports per block
BLOCKS = 30  # blocks: 20000..31999, below the ephemeral range and Mooncake's 32767 limit
SERVER_PORTS = 150  # the block's first ports: servers; the next 200: Mooncake's clients
LOCK_DIR = Path(tempfile.gettempdir()) / "embcache-test-ports"


class NoFreeBlock(RuntimeError):
    """Every block is leased by another running session."""


@dataclass
class Lease:
    """A block of ports held by this process (``lease``)."""

    first: int
    lock: IO[bytes]
    _next: int = field(default=0)

    def server_ports(self, count: int) -> list[int]:
        """``count`` distinct ports of the block's server range that bind now, in turn."""
        ports: list[int] = []
        for _ in range(SERVER_PORTS):
            if len(ports) == count:
                break
            port = self.first + self._next
            self._next = (self._next + 1) % SERVER_PORTS
            if port not in ports and _binds(port):
                ports.append(port)
        if len(ports) < count:
            raise NoFreeBlock(f"only {len(ports)} of {count} server ports bind in {self}")
        return ports

    def environment(self) -> dict[str, str]:
        """What Mooncake's clients and vLLM read for their own ports, inside the block."""
        clients = self.first + SERVER_PORTS  # 100 store-client ports, 100 engine RPC ports
        return {
            "MC_STORE_CLIENT_MIN_PORT": str(clients),
            "MC_STORE_CLIENT_MAX_PORT": str(clients + 99),
            "MC_MIN_RPC_PORT": str(clients + 100),
            "MC_MAX_RPC_PORT": str(clients + 199),
        }

    def __str__(self) -> str:
        return f"ports {self.first}..{self.first + BLOCK - 1}"


_lease: Lease | None = None


def lease() -> Lease:
    """This process's block, leased on first use (``NoFreeBlock`` when all are taken)."""
    global _lease
    if _lease is None:
        _lease = _take_block()
    return _lease


def server_ports(count: int) -> list[int]:
    """``count`` ports of this session's block for servers a test starts (module docstring)."""
    return lease().server_ports(count)


def environment() -> dict[str, str]:
    """The environment that keeps Mooncake's clients and vLLM inside this session's block."""
    return lease().environment()


def rendezvous(directory: Path | str) -> str:
    """A ``torch.distributed`` init method with no port at all: a file store in ``directory``
    (a fresh directory of this group; gloo's own connections then bind port 0, never a port
    chosen ahead)."""
    path = Path(directory) / "rendezvous"
    if path.exists():
        raise FileExistsError(f"{path} exists: give each group a fresh directory")
    return f"file://{path}"


def _take_block() -> Lease:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    start = os.getpid() % BLOCKS  # sessions started together try different blocks first
    for i in range(BLOCKS):
        index = (start + i) % BLOCKS
        handle = (LOCK_DIR / f"block-{index}.lock").open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return Lease(FIRST + index * BLOCK, handle)
    raise NoFreeBlock(f"all {BLOCKS} port blocks are leased (locks in {LOCK_DIR})")


def _binds(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
