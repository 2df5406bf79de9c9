"""``GroupChannel``: the collectives ``EncodePipeline`` runs over a tensor-parallel group.

Every rank gathers a header (failed?, item count, item fingerprint), so a failure on any rank
before the fallback mask, or ranks called with different items, raises on every rank; rank 0
then broadcasts the mask and the cached rows (as bytes, so any dtype travels unchanged); after
the encoder, the ranks agree (an all-reduce) on whether every encoder call succeeded. Each
collective waits at most ``collective_timeout`` seconds (None: the group's own timeout); one
that fails or times out raises ``TensorParallelError`` and leaves the group unusable.

With the NCCL backend the tensors travel on the encoder's device, with any other on the CPU.
No lock may be held across a collective (checked by ``assert_unlocked``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from embcache.driver.locks import assert_unlocked
from embcache.errors import TensorParallelError
from embcache.pipeline.plan import Plan, copy_rows

__all__ = ["GroupChannel"]


class GroupChannel:
    """The pipeline's side of one tensor-parallel group (source: the group's rank 0)."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, collective_timeout: float | None
    ) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)
        self._comm_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self._collective_timeout = (
            None if collective_timeout is None else datetime.timedelta(seconds=collective_timeout)
        )

    def share_failure(self) -> None:
        """Tell the group this rank failed before the mask; never raises (the cause wins)."""
        with contextlib.suppress(TensorParallelError):
            self._gather_header(None)

    def send(self, plan: Plan, mask: list[bool], answer: torch.Tensor) -> None:
        """Rank 0: agree on the items, then broadcast the mask and the held items' rows of
        ``answer`` (concatenated in item order)."""
        self._check_header(self._gather_header(plan))
        wire = torch.tensor(mask, dtype=torch.uint8, device=self._comm_device)
        self._broadcast(wire, "fallback mask")
        if plan.hit_rows(mask):
            at = plan.offsets
            held = [answer[at[n] : at[n + 1]] for n, masked in enumerate(mask) if not masked]
            rows = held[0] if len(held) == 1 else torch.cat(held)
            payload = rows.reshape(-1).view(torch.uint8).to(self._comm_device)
            self._broadcast(payload, "cached rows")

    def receive(self, plan: Plan, answer: torch.Tensor) -> list[bool]:
        """Other ranks: agree on the items, receive the mask and copy the held items' rows
        into their places in ``answer``; returns the mask."""
        self._check_header(self._gather_header(plan))
        wire = torch.empty(len(plan.items), dtype=torch.uint8, device=self._comm_device)
        self._broadcast(wire, "fallback mask")
        mask = [bool(v) for v in wire.tolist()]
        rows = plan.hit_rows(mask)
        nbytes = rows * math.prod(plan.tail) * plan.dtype.itemsize
        if not nbytes:
            return mask
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self._comm_device)
        self._broadcast(payload, "cached rows")
        held = payload.view(plan.dtype).view(rows, *plan.tail)
        row, at = 0, plan.offsets
        for n, masked in enumerate(mask):
            if not masked:
                rows_n = at[n + 1] - at[n]
                copy_rows(answer[at[n] : at[n + 1]], held[row : row + rows_n])
                row += rows_n
        return mask

    def agree_encoded(self, *, failed: bool) -> None:
        """All-reduce whether the encoder failed anywhere; raise if another rank's did."""
        flag = torch.tensor(
            [self._rank + 1 if failed else 0], dtype=torch.int64, device=self._comm_device
        )
        try:
            self._run(
                "encoder all_reduce",
                lambda: dist.all_reduce(flag, dist.ReduceOp.MAX, self._group, True),
            )
        except TensorParallelError:
            if failed:
                return  # the encoder's own exception is the one to raise
            raise
        worst = int(flag.item())
        if worst and not failed:
            raise TensorParallelError(
                f"the encoder failed on rank {worst - 1}; rank {self._rank} gives up this call too"
            )

    def _gather_header(self, plan: Plan | None) -> list[list[int]]:
        """All-gather (failed, item count, fingerprint) from every rank."""
        mine = torch.tensor(
            [1, 0, 0] if plan is None else [0, len(plan.items), plan.fingerprint()],
            dtype=torch.int64,
            device=self._comm_device,
        )
        everyone = [torch.empty_like(mine) for _ in range(self._world)]
        self._run("header all_gather", lambda: dist.all_gather(everyone, mine, self._group, True))
        return [t.tolist() for t in everyone]

    def _check_header(self, rows: list[list[int]]) -> None:
        failed = [rank for rank, row in enumerate(rows) if row[0]]
        if failed:
            raise TensorParallelError(
                f"rank(s) {failed} failed before the fallback mask; rank {self._rank} gives up "
                "this call too (see the failing rank's exception)"
            )
        differ = [rank for rank, row in enumerate(rows) if row[1:] != rows[0][1:]]
        if differ:
            raise TensorParallelError(
                f"rank(s) {differ} were called with other items than rank 0: every rank must "
                "encode the same items in the same order"
            )

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self._run(f"{what} broadcast", lambda: dist.broadcast(tensor, self._src, self._group, True))

    def _run(self, what: str, start: Callable[[], Any]) -> None:
        """Start one collective and wait for it, bounded; failures are ``TensorParallelError``."""
        assert_unlocked(what)
        try:
            work = start()
            if self._collective_timeout is None:
                work.wait()
            else:
                work.wait(self._collective_timeout)
        except RuntimeError as exc:
            raise TensorParallelError(
                f"{what} failed on rank {self._rank} of {self._world} ({exc}); the group may be "
                "unusable now: rebuild it"
            ) from exc
