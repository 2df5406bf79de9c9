"""What a request asks for: an embedding named by its key, with its shape and dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from embcache.errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True, slots=True)
class Item:
    """One embedding: ``key`` is the image hash, ``shape``/``dtype`` describe the tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Payload size in bytes (the dtype's own width: bf16 takes 2 bytes per element), computed
    # once: the core reads it at every miss.
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_key(self.key)
        if not isinstance(self.shape, tuple) or not self.shape:
            raise InvalidTypeError(f"shape must be a non-empty tuple of ints, got {self.shape!r}")
        for dim in self.shape:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise InvalidTypeError(f"shape dims must be ints, got {self.shape!r}")
            if dim <= 0:
                raise InvalidArgumentError(f"shape dims must be > 0, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidTypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        _set(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> Item:
        """The item describing ``tensor`` under ``key``; raises as ``Item(...)`` does for a
        bad key, and ``InvalidTypeError`` for a ``tensor`` that is not a tensor."""
        if not isinstance(tensor, torch.Tensor):
            raise InvalidTypeError(
                f"expected a torch.Tensor for {key!r}, got {type(tensor).__name__}"
            )
        shape = tuple(tensor.shape)  # a torch.Size: ints, none negative
        if shape and min(shape) > 0 and type(key) is str and key:  # what __post_init__ checks
            item = _new(cls)  # a tensor's fields pass every check: no __init__/__post_init__
            _set(item, "key", key)
            _set(item, "shape", shape)
            _set(item, "dtype", tensor.dtype)
            _set(item, "nbytes", math.prod(shape) * tensor.dtype.itemsize)
            return item
        return cls(key, shape, tensor.dtype)  # raises what the checks say

    @classmethod
    def of_matrix(cls, key: str, rows: int, width: int, dtype: torch.dtype) -> Item:
        """The item of a ``rows`` x ``width`` embedding of ``dtype`` under ``key`` (what an
        engine's connector knows of a multimodal item); raises as ``Item(...)`` does."""
        if (
            type(key) is str
            and key
            and type(rows) is int
            and type(width) is int
            and rows > 0
            and width > 0
            and isinstance(dtype, torch.dtype)
        ):  # what __post_init__ checks
            item = _new(cls)
            _set(item, "key", key)
            _set(item, "shape", (rows, width))
            _set(item, "dtype", dtype)
            _set(item, "nbytes", rows * width * dtype.itemsize)
            return item
        return cls(key, (rows, width), dtype)  # raises what the checks say


_new = object.__new__
_set = object.__setattr__  # (the dataclass is frozen)


def check_key(key: object) -> str:
    """``key`` if it is a non-empty str; else ``InvalidTypeError`` or ``InvalidArgumentError``."""
    if not isinstance(key, str):
        raise InvalidTypeError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidArgumentError("key must be a non-empty str")
    return key
