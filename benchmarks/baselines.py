"""Baselines that reproduce the naive designs embcache replaces, for side-by-side benchmarks."""

from __future__ import annotations


class NaiveAllocator:
    """First fit by linear scan of an address-sorted free list; free re-sorts and re-merges."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.alignment = alignment
        self.free_list: list[list[int]] = [[0, capacity]]
        self.allocated: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.alignment) * self.alignment
        for i, block in enumerate(self.free_list):
            if block[1] >= size:
                offset = block[0]
                if block[1] == size:
                    del self.free_list[i]
                else:
                    block[0] += size
                    block[1] -= size
                self.allocated[offset] = size
                return offset
        return None

    def free(self, offset: int) -> int:
        size = self.allocated.pop(offset)
        self.free_list.append([offset, size])
        self.free_list.sort()
        merged: list[list[int]] = []
        for block in self.free_list:
            if merged and merged[-1][0] + merged[-1][1] == block[0]:
                merged[-1][1] += block[1]
            else:
                merged.append(block)
        self.free_list = merged
        return size

    @property
    def largest_free_block(self) -> int:
        return max((b[1] for b in self.free_list), default=0)
