"""The cache's pool: a new uint8 tensor, or one the caller gives (for example a mapping of
shared memory that other processes read), and its zero-copy views (an entry's bytes as a
tensor of its shape and dtype)."""

from __future__ import annotations

import functools
import math

import torch

from embcache.core.entries import Entry, ItemLike
from embcache.core.outcomes import TransferOutcome
from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["PoolViews", "make_pool", "payload_nbytes"]


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


class PoolViews:
    """Views of one uint8 pool tensor; the pool viewed as each dtype is made once."""

    def __init__(self, pool: torch.Tensor) -> None:
        self._pool = pool
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def view(self, offset: int, item: ItemLike | Entry) -> torch.Tensor:
        """``item``'s bytes at ``offset`` as a tensor of its shape and dtype (zero-copy): one
        ``as_strided`` of the pool viewed as the dtype (slicing and two ``.view`` calls cost
        5x more)."""
        dtype: torch.dtype = item.dtype  # type: ignore[assignment]
        typed = self._typed.get(dtype)
        if typed is None:  # one view of the whole pool per dtype; a race makes two, both valid
            typed = self._typed.setdefault(dtype, self._pool.view(dtype))
        return typed.as_strided(item.shape, _strides(item.shape), offset // dtype.itemsize)

    def copy_in(
        self, filling: list[tuple[Entry, torch.Tensor]]
    ) -> tuple[list[TransferOutcome], BaseException | None]:
        """Copy each tensor into its entry's range: OK per copy; the first copy that raises
        fails itself and every copy after it (FAILED), and its error is returned."""
        outcomes = [TransferOutcome.FAILED] * len(filling)
        with torch.no_grad():
            for i, (entry, tensor) in enumerate(filling):
                try:
                    self.view(entry.offset, entry).copy_(tensor)
                except BaseException as exc:
                    return outcomes, exc
                outcomes[i] = TransferOutcome.OK
        return outcomes, None


def payload_nbytes(entry: Entry) -> int:
    """The payload bytes of ``entry`` (its range may be larger: rounded to the alignment)."""
    dtype: torch.dtype = entry.dtype  # type: ignore[assignment]
    return math.prod(entry.shape) * dtype.itemsize


@functools.lru_cache(maxsize=1024)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major (contiguous) strides of ``shape``, in elements."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
