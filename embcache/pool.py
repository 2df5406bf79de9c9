"""The cache's pool: a new uint8 tensor, or one the caller gives (for example a mapping of
shared memory that other processes read)."""

from __future__ import annotations

import torch

from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["make_pool"]


def make_pool(capacity_bytes: int, pin_memory: bool, pool: object = None) -> torch.Tensor:
    """``pool`` if it can be the pool (a contiguous 1-D uint8 CPU tensor of ``capacity_bytes``
    elements), else ``InvalidTypeError``/``InvalidArgumentError``; with None a new tensor,
    pinned when asked. O(1) (the kernel zero-fills a new tensor's pages on first touch)."""
    if pool is None:
        return torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory)
    if not isinstance(pool, torch.Tensor):
        raise InvalidTypeError(f"pool must be a torch.Tensor or None, got {type(pool).__name__}")
    if pool.dtype != torch.uint8 or pool.dim() != 1 or not pool.is_contiguous():
        raise InvalidArgumentError(
            f"pool must be a contiguous 1-D uint8 tensor, got {pool.dtype} of shape "
            f"{tuple(pool.shape)}: pass torch.empty(capacity_bytes, dtype=torch.uint8) or a view"
        )
    if pool.device.type != "cpu" or pool.numel() != capacity_bytes:
        raise InvalidArgumentError(
            f"pool must be a CPU tensor of capacity_bytes={capacity_bytes!r} bytes, got "
            f"{pool.numel()} bytes on {pool.device}"
        )
    return pool
