"""Reference model of ``embcache.RangeAllocator``: a dict of allocations, free space recomputed.

Everything is O(n) or worse on purpose; the point is that each line is obviously right.
Errors are predicted as the exception class the real allocator must raise.
"""

from __future__ import annotations

from embcache.errors import InvalidArgumentError, InvalidTypeError, NotAllocatedError


class ModelAllocator:
    def __init__(self, capacity: int, alignment: int) -> None:
        self.capacity = capacity
        self.alignment = alignment
        self.allocated: dict[int, int] = {}

    def free_blocks(self) -> list[tuple[int, int]]:
        """Maximal gaps between allocations, in address order."""
        gaps, cursor = [], 0
        for offset in sorted(self.allocated):
            if offset > cursor:
                gaps.append((cursor, offset - cursor))
            cursor = offset + self.allocated[offset]
        if cursor < self.capacity:
            gaps.append((cursor, self.capacity - cursor))
        return gaps

    def rounded(self, nbytes: object) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise InvalidTypeError(nbytes)
        if nbytes <= 0 or nbytes > self.capacity:
            raise InvalidArgumentError(nbytes)
        return -(-nbytes // self.alignment) * self.alignment

    def allocate(self, nbytes: object) -> int | None:
        size = self.rounded(nbytes)
        fits = [(s, o) for o, s in self.free_blocks() if s >= size]
        if not fits:
            return None
        _, offset = min(fits)
        self.allocated[offset] = size
        return offset

    def free(self, offset: object) -> int:
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise InvalidTypeError(offset)
        if offset not in self.allocated:
            raise NotAllocatedError(offset)
        return self.allocated.pop(offset)

    def size_of(self, offset: int) -> int:
        if offset not in self.allocated:
            raise NotAllocatedError(offset)
        return self.allocated[offset]

    @property
    def allocated_bytes(self) -> int:
        return sum(self.allocated.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.allocated_bytes

    @property
    def largest_free_block(self) -> int:
        return max((s for _, s in self.free_blocks()), default=0)
