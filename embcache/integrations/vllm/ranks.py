"""Which ranks are dead: told by their worker processes' exit, never guessed from a timeout.

Theory of operation. vLLM 0.33.0 has no heartbeat and no death notice for an encoder-cache
connector: its ``MultiprocExecutor`` learns that a worker died from the worker process's
sentinel (``MultiprocWorkerMonitor``), then shuts the executor down and fails the engine, which
ends with ``ECConnectorBase.shutdown``. The connector uses the same signal, the process's exit:
each worker connector announces its process in its first acks (``WorkerIdentity``: the boot id
of its machine and its pid), the scheduler opens a pidfd for it (``os.pidfd_open``: it names
that very process, never one that reuses the pid later) and a rank is dead once its pidfd is
readable. Until then a rank that does not ack is slow, however long it takes: its holds stay.

A rank that never announced, runs on another machine (another boot id) or whose pidfd cannot
be opened is never found dead here; its holds stay until its acks come or the engine stops.
A pid that no longer exists when announced is a process that already exited: dead. O(ranks)
per ``dead_now``; the scheduler asks only while a finished request's acks are owed.
"""

from __future__ import annotations

import logging
import os
import select
from functools import cache
from typing import NamedTuple

from embcache.errors import InvalidArgumentError

__all__ = ["RankWatch", "WorkerIdentity", "identity"]
log = logging.getLogger(__name__)


class WorkerIdentity(NamedTuple):
    """A worker process: the boot id of its machine and its pid."""

    boot: str
    pid: int


@cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""  # unknown: no process is watched by pidfd


def identity() -> WorkerIdentity:
    """This process's identity, as a worker announces it."""
    return WorkerIdentity(_boot_id(), os.getpid())


class RankWatch:
    """The worker processes of ``ranks`` ranks, watched by pidfd. Not thread-safe (the
    scheduler's one thread)."""

    def __init__(self, ranks: int) -> None:
        self._ranks = ranks
        self._fds: dict[int, int] = {}  # rank -> pidfd, while it runs
        self._pids: dict[int, int] = {}  # rank -> the pid it announced on this machine
        self._announced: set[int] = set()
        self._dead: set[int] = set()
        self._poll = select.poll()

    def announce(self, rank: object, who: object) -> bool:
        """Rank ``rank`` runs in process ``who``; True when that process already exited (the
        rank is dead). A rank announced before, out of range, or an identity not of this
        machine is ignored (False). O(1)."""
        if not (isinstance(rank, int) and 0 <= rank < self._ranks) or rank in self._announced:
            return False
        self._announced.add(rank)
        if not (isinstance(who, tuple) and len(who) == 2):
            return False
        boot, pid = who
        if not boot or boot != _boot_id() or not isinstance(pid, int) or pid <= 0:
            return False
        self._pids[rank] = pid
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # it exited before we looked: the rank is dead
            return self._mark(rank)
        except (OSError, AttributeError):  # no pidfd here: never found dead by this watch
            log.warning("rank %d (pid %d): cannot watch its process", rank, pid, exc_info=True)
            return False
        self._fds[rank] = fd
        self._poll.register(fd, select.POLLIN)
        return False

    def dead_now(self) -> list[int]:
        """The ranks whose process exited since the last call (each once). O(ranks)."""
        if not self._fds:
            return []
        by_fd = {fd: rank for rank, fd in self._fds.items()}
        return [by_fd[fd] for fd, _ in self._poll.poll(0) if self._mark(by_fd[fd])]

    def pid(self, rank: int) -> int | None:
        """The pid rank ``rank`` announced on this machine (None: none). O(1)."""
        return self._pids.get(rank)

    def watched(self) -> dict[int, int]:
        """rank -> pid of the processes watched now (announced here, not known dead). O(ranks)."""
        return {rank: self._pids[rank] for rank in sorted(self._fds)}

    def mark_dead(self, rank: int) -> bool:
        """Rank ``rank`` is dead (the engine's failure path says so); True if news."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._ranks:
            raise InvalidArgumentError(f"rank must be in [0, {self._ranks}), got {rank!r}")
        return self._mark(rank)

    def close(self) -> None:
        """Close every pidfd."""
        for rank in list(self._fds):
            self._forget(rank)

    def _mark(self, rank: int) -> bool:
        self._forget(rank)
        if rank in self._dead:
            return False
        self._dead.add(rank)
        return True

    def _forget(self, rank: int) -> None:
        fd = self._fds.pop(rank, None)
        if fd is not None:
            self._poll.unregister(fd)
            os.close(fd)
