"""``Plan``: one validated ``EncodePipeline.encode`` call, the same on every rank.

It fixes the items and their inputs, the dtype and the shape after dim 0 that every item shares
(the result is their concatenation along dim 0), each item's rows in the result, and a
fingerprint the tensor-parallel ranks compare to make sure they were called with the same items.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embcache.driver.item import Item
from embcache.errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class Plan:
    """A validated call: items, inputs, and what the result looks like."""

    items: list[Item]
    inputs: list[Any]
    dtype: torch.dtype
    tail: tuple[int, ...]  # shape after dim 0, common to every item
    offsets: tuple[int, ...]  # item i's rows in the result: offsets[i]:offsets[i + 1]

    def fallbacks(self, mask: Sequence[bool]) -> tuple[list[Item], list[Any]]:
        """The masked items and their inputs, each key once, in item order."""
        seen: set[str] = set()
        items: list[Item] = []
        inputs: list[Any] = []
        for item, value, masked in zip(self.items, self.inputs, mask, strict=True):
            if masked and item.key not in seen:
                seen.add(item.key)
                items.append(item)
                inputs.append(value)
        return items, inputs

    def fingerprint(self) -> int:
        """A 56-bit digest of the items' keys, shapes and dtypes, in order: what the ranks of a
        tensor-parallel group compare (computed on demand: a call without a group skips it)."""
        digest = hashlib.blake2b(digest_size=7)
        for item in self.items:
            digest.update(f"{item.key}|{item.shape}|{item.dtype};".encode())
        return int.from_bytes(digest.digest(), "big")

    def hit_rows(self, mask: Sequence[bool]) -> int:
        """Rows of the items ``mask`` does not mark."""
        return sum(it.shape[0] for it, masked in zip(self.items, mask, strict=True) if not masked)

    def empty_result(self, device: torch.device) -> torch.Tensor:
        """The call's result, unwritten: every item's rows, in order along dim 0."""
        return torch.empty((self.offsets[-1], *self.tail), dtype=self.dtype, device=device)


def make_plan(items: Sequence[Item], inputs: Sequence[Any]) -> Plan:
    """Validate a call; raises ``InvalidTypeError``/``InvalidArgumentError`` naming the problem."""
    if isinstance(items, Item) or not isinstance(items, Sequence):
        raise InvalidTypeError(f"items must be a sequence of Item, got {type(items).__name__}")
    if not isinstance(inputs, Sequence) or isinstance(inputs, str | bytes):
        raise InvalidTypeError(f"inputs must be a sequence, got {type(inputs).__name__}")
    if not items:
        raise InvalidArgumentError("encode needs at least one item")
    if len(items) != len(inputs):
        raise InvalidArgumentError(
            f"{len(items)} items but {len(inputs)} inputs: give one input per item"
        )
    first = items[0]
    if not isinstance(first, Item):
        raise InvalidTypeError(f"items must be Item, got {type(first).__name__}")
    seen: dict[str, Item] = {}
    offsets = [0]
    for item in items:
        if not isinstance(item, Item):
            raise InvalidTypeError(f"items must be Item, got {type(item).__name__}")
        if item.dtype != first.dtype or item.shape[1:] != first.shape[1:]:
            raise InvalidArgumentError(
                f"{item.key!r} is {item.shape} {item.dtype} but {first.key!r} is "
                f"{first.shape} {first.dtype}: items are concatenated along dim 0, so they must "
                "share the dtype and every other dim"
            )
        first = seen.setdefault(item.key, item)
        if first is not item and first != item:  # (no dataclass ``__eq__`` for a new key)
            raise InvalidArgumentError(
                f"{item.key!r} appears as {seen[item.key].shape} and as {item.shape}: one key "
                "names one embedding"
            )
        offsets.append(offsets[-1] + item.shape[0])
    return Plan(
        items=list(items),
        inputs=list(inputs),
        dtype=first.dtype,
        tail=first.shape[1:],
        offsets=tuple(offsets),
    )


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, as bytes for the dtypes torch has no copy kernel for (the bit-width
    placeholders such as ``int1``: their tensors are plain contiguous bytes)."""
    try:
        dst.copy_(src)
    except NotImplementedError:  # raised before anything is copied
        dst.view(torch.uint8).copy_(src.contiguous().view(torch.uint8))
