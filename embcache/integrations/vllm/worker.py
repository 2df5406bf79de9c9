"""The worker role (one per rank): copies the step's loads from the shared pool into vLLM's
``encoder_cache`` on this rank's device, copies fresh outputs into the pool ranges the
scheduler reserved for them (rank 0), and returns its acks (embcache/DESIGN.md, "vLLM: the
scheduler/worker split")."""

from __future__ import annotations

import torch

from embcache.integrations.vllm.protocol import (
    EmbcacheECMetadata,
    EmbcacheECWorkerMetadata,
    StepKey,
    Transfer,
)
from embcache.integrations.vllm.ranks import identity
from embcache.integrations.vllm.shm import PoolHandle, attach

__all__ = ["WorkerSide"]


class WorkerSide:
    """Rank ``rank``'s side; loaded tensors go to ``device``."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self._handle: PoolHandle | None = None
        self._pool: torch.Tensor | None = None
        self._loaded: list[StepKey] = []
        self._saved: dict[StepKey, bool] = {}
        self._announce = True  # the first acks say which process this rank runs in

    def load(self, meta: EmbcacheECMetadata, encoder_cache: dict[str, torch.Tensor]) -> None:
        """``start_load_caches``: a new tensor per load in ``encoder_cache``, then its ack.
        O(bytes loaded)."""
        for t in meta.loads:
            encoder_cache[t.key] = self._view(meta.pool, t).to(self.device, copy=True)
            self._loaded.append((meta.step, t.key))

    def save(
        self, meta: EmbcacheECMetadata, encoder_cache: dict[str, torch.Tensor], key: str
    ) -> None:
        """``save_caches`` (rank 0): copy ``encoder_cache[key]`` into its pool range if this
        step reserved one; the ack says whether shape and dtype matched. O(bytes)."""
        if self.rank != 0:
            return
        for t in meta.saves:
            if t.key == key:
                tensor = encoder_cache.get(key)
                fits = tensor is not None and tuple(tensor.shape) == t.shape
                if fits and tensor is not None and tensor.dtype == t.dtype:
                    self._view(meta.pool, t).copy_(tensor)
                    self._saved[(meta.step, key)] = True
                else:
                    self._saved[(meta.step, key)] = False
                return

    def acks(self, meta: EmbcacheECMetadata | None = None) -> EmbcacheECWorkerMetadata | None:
        """``build_connector_worker_meta``: the acks since the last call, or None; on rank 0,
        a save of ``meta`` (the step's metadata) never written is acked False; the first call
        also announces this rank's process (``ranks.WorkerIdentity``). O(acks)."""
        if meta is not None and self.rank == 0:
            for t in meta.saves:
                self._saved.setdefault((meta.step, t.key), False)
        if not (self._loaded or self._saved or self._announce):
            return None
        acks = EmbcacheECWorkerMetadata(
            {self.rank: self._loaded} if self._loaded else {},
            self._saved,
            {self.rank: (me.boot, me.pid)} if self._announce and (me := identity()) else {},
        )
        self._loaded, self._saved, self._announce = [], {}, False
        return acks

    def _view(self, handle: PoolHandle, t: Transfer) -> torch.Tensor:
        if handle != self._handle or self._pool is None:
            self._pool = attach(handle)
            self._handle = handle
        return self._pool[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape)
