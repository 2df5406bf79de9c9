"""Baselines that reproduce the naive designs embcache replaces, for side-by-side benchmarks."""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList


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


class MinimalBestFit:
    """Best fit at its barest: free blocks in two sortedcontainers indexes (by offset, to
    coalesce; by (size, offset), to find the smallest fit), allocations in a dict. No argument
    checks, no lock, no invariant checks: the floor for ``RangeAllocator``'s cost."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        self.alignment = alignment
        self.by_offset = SortedDict({0: capacity})
        self.by_size = SortedList([(capacity, 0)])
        self.allocated: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.alignment) * self.alignment
        index = self.by_size.bisect_left((size, -1))
        if index == len(self.by_size):
            return None
        block, offset = self.by_size.pop(index)
        del self.by_offset[offset]
        if block > size:
            self.by_offset[offset + size] = block - size
            self.by_size.add((block - size, offset + size))
        self.allocated[offset] = size
        return int(offset)

    def free(self, offset: int) -> int:
        size = self.allocated.pop(offset)
        start, end = offset, offset + size
        index = self.by_offset.bisect_left(start)
        if index:
            before, before_size = self.by_offset.peekitem(index - 1)
            if before + before_size == start:
                del self.by_offset[before]
                self.by_size.remove((before_size, before))
                start = before
        after_size = self.by_offset.pop(end, None)
        if after_size is not None:
            self.by_size.remove((after_size, end))
            end += after_size
        self.by_offset[start] = end - start
        self.by_size.add((end - start, start))
        return size
