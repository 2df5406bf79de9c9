"""The shared pool: one anonymous memory file that the scheduler creates and every rank maps.

The scheduler-role connector makes it with ``memfd_create`` (mode 0600, named
``embcache-vllm-<128 random bits>``), so it never has a name in ``/dev/shm``: nothing can be
left there when the engine stops or is killed, and the memory goes away with the last process
that maps it. A rank opens it through ``/proc/<scheduler pid>/fd/<fd>`` (which only the
engine's user, or root, may open) after checking that the link names the same random token,
so a reused pid or fd number cannot hand it someone else's memory.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from dataclasses import dataclass

import torch

from embcache.errors import ClosedError, InvalidArgumentError, StoreUnavailableError

__all__ = ["NAME_PREFIX", "PoolHandle", "SharedPool", "attach"]

NAME_PREFIX = "embcache-vllm-"


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """How a rank finds the pool: the owner's pid and fd, the name's token, the size."""

    pid: int
    fd: int
    token: str
    size: int

    @property
    def path(self) -> str:
        """The owner's descriptor as seen from another process of the same user."""
        return f"/proc/{self.pid}/fd/{self.fd}"


class SharedPool:
    """``size`` bytes of shared memory, mapped here as ``tensor`` (uint8, 1-D). O(1) to make;
    the kernel zero-fills pages on first touch."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidArgumentError(f"shared pool size must be an int > 0, got {size!r}")
        token = secrets.token_hex(16)
        fd = os.memfd_create(NAME_PREFIX + token, os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.handle = PoolHandle(os.getpid(), fd, token, size)

    def close(self) -> None:
        """Close the descriptor (no rank can attach any more); the mapping goes with the last
        tensor that views it. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._map = None


def attach(handle: PoolHandle) -> torch.Tensor:
    """Map the pool ``handle`` names (uint8, 1-D); ``StoreUnavailableError`` saying why not."""
    try:
        link = os.readlink(handle.path)
        if not link.startswith(f"/memfd:{NAME_PREFIX}{handle.token}"):
            raise ClosedError(f"{handle.path} is {link!r}, not the pool {handle.token}")
        fd = os.open(handle.path, os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ClosedError) as exc:
        raise StoreUnavailableError(
            f"cannot map the scheduler's shared pool ({exc}): the engine's scheduler process "
            f"{handle.pid} must be alive and run as this user"
        ) from exc
    try:
        info = os.fstat(fd)
        if info.st_size != handle.size or stat.S_IMODE(info.st_mode) != 0o600:
            raise StoreUnavailableError(
                f"shared pool {handle.path}: size {info.st_size}, mode "
                f"{stat.S_IMODE(info.st_mode):o}; expected {handle.size} bytes, mode 600"
            )
        mapping = mmap.mmap(fd, handle.size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)
