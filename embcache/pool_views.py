"""Zero-copy views of the pool: an entry's bytes as a tensor of its shape and dtype."""

from __future__ import annotations

import functools
import math

import torch

from embcache.core.entries import Entry, ItemLike


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
