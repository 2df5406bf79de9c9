"""The older SGLang controller interface (``mem_cache/storage/mooncake_store/
embedding_cache_controller.py`` of the original pull request), on embcache.

Its request runs ``batch_is_exist``, ``prefetch``, ``check_prefetch_progress`` polled, then
``get_embeddings`` of the hits (a view per hash, None where the load failed: encode it),
``release_embeddings`` when the views are no longer needed, and ``insert_batch`` of the fresh
encoder outputs. Pins are held from ``prefetch`` until ``release_embeddings``, exactly as in
``embcache.integrations.sglang``, whose prefetch, reads and stats this class shares.
"""

from __future__ import annotations

from typing import Any

import torch

from embcache import Item, Status
from embcache.errors import InvalidArgumentError
from embcache.integrations.sglang import ControllerBase, as_2d

__all__ = ["LegacyEmbeddingCacheController"]


class LegacyEmbeddingCacheController(ControllerBase):
    """The original pull request's controller: its constructor, plus ``embedding_store`` (an
    embcache ``GlobalStore``; None builds a Mooncake client from the ``MOONCAKE_*``
    environment, as that controller did) and ``dtype`` (it was float32 only)."""

    def __init__(
        self,
        tp_rank: int,
        tp_size: int,
        max_pool_size_gb: float = 4.0,
        hidden_dims: dict[Any, int] | None = None,
        tp_group: Any = None,
        all_rank_get: bool = False,
        *,
        embedding_store: Any = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if tp_size > 1 and tp_group is None:
            raise InvalidArgumentError(f"tp_group must be given when tp_size={tp_size} > 1")
        self.all_rank_get = all_rank_get
        pool_bytes = int(max_pool_size_gb * (1 << 30)) // 256 * 256
        if pool_bytes <= 0:
            raise InvalidArgumentError(
                f"max_pool_size_gb={max_pool_size_gb} gives no pool: give at least 256 bytes' worth"
            )
        tp = (tp_size, tp_rank, tp_group)
        self._setup(embedding_store, pool_bytes, hidden_dims, dtype, tp, {})

    def get_embeddings(self, image_hashes: list[str]) -> list[torch.Tensor | None]:
        """Per hash, a zero-copy (tokens, dim) view pinned until ``release_embeddings`` of the
        hash; None where the hash is not held (encode it)."""
        return self._fresh_views(image_hashes)

    def release_embeddings(self, image_hashes: list[str]) -> None:
        """End one read of each hash (``get_embeddings``); the last one frees the pins."""
        self._give_back(image_hashes)

    def insert_batch(
        self, image_hashes: list[str], embedding_tensors: list[torch.Tensor]
    ) -> list[bool]:
        """Copy fresh outputs into the pool and publish them; True where inserted. A hash
        already present (same shape) is kept as it is and published again, as that controller
        pushed every key it was given."""
        keys = list(image_hashes)
        rows = [as_2d(t).to(self.dtype) for t in embedding_tensors]
        with self._request("insert") as request:
            inserted = request.insert(keys, rows, publish=True)
            present = [
                Item(k, tuple(r.shape), self.dtype)
                for k, r, new in zip(keys, rows, inserted, strict=True)
                if not new
            ]
            if present:
                statuses = request.lookup(present, prefetch=False)
                found = zip(present, statuses, strict=True)
                request.publish([i.key for i, s in found if s.status is Status.HIT])
            return inserted
