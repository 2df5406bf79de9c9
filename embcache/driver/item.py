"""What a request asks for: an embedding named by its key, with its shape and dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
        _NBYTES(self, math.prod(self.shape) * self.dtype.itemsize)

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
            dtype = tensor.dtype  # a tensor's fields pass every check: no __post_init__
            return _checked(cls, key, shape, dtype, math.prod(shape) * dtype.itemsize)
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
            return _checked(cls, key, (rows, width), dtype, rows * width * dtype.itemsize)
        return cls(key, (rows, width), dtype)  # raises what the checks say

    @classmethod
    def of_matrices(
        cls, keys: Sequence[str], rows: Sequence[int], width: int, dtype: torch.dtype
    ) -> list[Item]:
        """``[Item.of_matrix(k, r, width, dtype) for k, r in zip(keys, rows)]`` (an engine's
        batch of items of one width), with ``width`` and ``dtype`` checked once and each key
        and row count per item. Raises as ``Item(...)`` does, ``InvalidTypeError`` when
        ``keys`` or ``rows`` is not a sequence (a ``str`` is not a sequence of keys here), and
        ``InvalidArgumentError`` when they differ in length. O(keys)."""
        if type(keys) not in _LISTS or type(rows) not in _LISTS:
            _check_sequences(keys, rows)  # raises unless both are sequences (not str)
        if len(keys) != len(rows):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(rows)} row counts")
        if not (type(width) is int and width > 0 and isinstance(dtype, torch.dtype)):
            cls("width", (1, width), dtype)  # raises what the checks say
        if not (
            set(map(type, keys)) <= _STR and "" not in keys
            and set(map(type, rows)) <= _INT and (not rows or min(rows) > 0)
        ):  # (every key and row count checked in C: no bytecode per item)  # fmt: skip
            for key, n in zip(keys, rows, strict=True):
                cls(key, (n, width), dtype)  # raises what the checks say at the first bad one
        itemsize, checked = dtype.itemsize, _checked
        return [
            checked(cls, key, (n, width), dtype, n * width * itemsize)
            for key, n in zip(keys, rows, strict=True)
        ]


_new = object.__new__
_STR, _INT = frozenset((str,)), frozenset((int,))
_LISTS = frozenset((list, tuple))  # the sequences ``of_matrices`` takes without an ABC check
# The slots' own setters (member descriptors: the dataclass is frozen).
_KEY, _SHAPE, _DTYPE, _NBYTES = (vars(Item)[f].__set__ for f in ("key", "shape", "dtype", "nbytes"))


def _checked(
    cls: type[Item], key: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int
) -> Item:
    """An item of fields its caller checked as ``__post_init__`` would: made without
    ``__init__`` (the constructors' fast path)."""
    item = _new(cls)
    _KEY(item, key)
    _SHAPE(item, shape)
    _DTYPE(item, dtype)
    _NBYTES(item, nbytes)
    return item


def check_key(key: object) -> str:
    """``key`` if it is a non-empty str; else ``InvalidTypeError`` or ``InvalidArgumentError``."""
    if not isinstance(key, str):
        raise InvalidTypeError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidArgumentError("key must be a non-empty str")
    return key


def _check_sequences(keys: object, rows: object) -> None:
    """Raise ``InvalidTypeError`` unless ``keys`` and ``rows`` are sequences, neither a str."""
    for name, value in (("keys", keys), ("rows", rows)):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise InvalidTypeError(
                f"of_matrices takes {name} as a sequence (a list), got {type(value).__name__}"
            )
