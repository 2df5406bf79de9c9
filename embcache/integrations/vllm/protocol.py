"""What travels between the roles: the step's metadata (scheduler -> every rank, pickled in
vLLM's ``SchedulerOutput``) and each rank's acks (rank -> scheduler, merged by ``aggregate``).
See embcache/DESIGN.md, "vLLM: the scheduler/worker split"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from embcache.integrations.vllm.shm import PoolHandle

__all__ = ["EmbcacheECMetadata", "EmbcacheECWorkerMetadata", "Transfer"]

StepKey = tuple[int, str]  # (step, identifier): one load or save


class Transfer(NamedTuple):
    """One embedding in the shared mapping: ``key`` at byte ``offset``, ``shape``, ``dtype``
    (a tuple: the scheduler makes one per load or save on vLLM's critical path)."""

    key: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class EmbcacheECMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """One engine step: every rank loads ``loads`` into its encoder cache; rank 0 copies the
    fresh outputs named by ``saves`` into their pool ranges (reserved, LOADING)."""

    step: int
    pool: PoolHandle
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class EmbcacheECWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """Acks: ``loaded[rank]`` the (step, key) loads that rank finished; ``saved[(step, key)]``
    whether rank 0 wrote that save's pool range (False: the tensor did not match, or vLLM did
    not ask it to save that item this step); ``alive[rank]`` the worker process a rank runs in,
    announced once (``embcache.integrations.vllm.ranks``: how its death is learned)."""

    loaded: dict[int, list[StepKey]] = field(default_factory=dict)
    saved: dict[StepKey, bool] = field(default_factory=dict)
    alive: dict[int, tuple[str, int]] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> EmbcacheECWorkerMetadata:
        """A new object holding the acks of both (neither is changed). O(acks)."""
        if not isinstance(other, EmbcacheECWorkerMetadata):
            return self
        loaded = {rank: list(acks) for rank, acks in self.loaded.items()}
        for rank, acks in other.loaded.items():
            loaded.setdefault(rank, []).extend(acks)
        alive = {**self.alive, **other.alive}
        return EmbcacheECWorkerMetadata(loaded, {**self.saved, **other.saved}, alive)
