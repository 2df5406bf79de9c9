"""Rank processes for the tests that run a ``torch.distributed`` group: started together,
waited for up to a deadline, and never left behind (``spawned_ranks``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.multiprocessing.spawn import ProcessContext, start_processes

__all__ = ["Ended", "spawned_ranks"]


@dataclass(frozen=True)
class Ended:
    """How the ranks ended: each one's exit code (negative: the signal that ended it; a rank
    still running at the deadline was killed) and whether all ended by the deadline."""

    exit_codes: list[int | None]
    in_time: bool


def spawned_ranks(
    worker: Callable[..., None],
    args: tuple[Any, ...],
    world: int,
    deadline_s: float,
    env: Mapping[str, str] | None = None,
) -> Ended:
    """Run ``worker(rank, *args)`` for ``world`` ranks in spawned processes, with ``env`` set
    for them (and restored here after); wait until all end or ``deadline_s`` passes, then kill
    and reap any still running. A rank that raised or died does not raise here (torch's join
    then ends the others with SIGTERM): its exit code says so, and what it recorded says
    where."""
    env = dict(env or {})
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        context: ProcessContext = start_processes(  # type: ignore[no-untyped-call]
            worker, args=args, nprocs=world, join=False, start_method="spawn"
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + deadline_s
    in_time = False
    try:
        # a rank that raised or died raises here, torch having terminated the others
        with contextlib.suppress(Exception):
            while not context.join(timeout=0.5) and time.monotonic() <= deadline:
                pass
        in_time = not any(p.is_alive() for p in context.processes)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return Ended([p.exitcode for p in context.processes], in_time)
