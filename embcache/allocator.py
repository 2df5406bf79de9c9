"""Best-fit byte-range allocator over one buffer ``[0, capacity)``; it owns no memory.

Theory of operation: the buffer is partitioned into blocks, each free or allocated. Free
blocks are indexed twice, by offset (to coalesce with neighbours) and by ``(size, offset)``
(to find the best fit); allocated blocks are indexed by offset. Sizes are rounded up to the
alignment, so every block boundary is a multiple of it. ``allocate`` takes the smallest free
block that fits (lowest offset among equal sizes) and carves the allocation from its start;
``free`` merges the block with free neighbours on both sides, so the free list is always
fully coalesced. Same calls, same offsets: a reference model can predict every result.

Thread-safe: one internal lock, level 2 of the hierarchy (``embcache.locks``). A caller that
holds the cache lock (level 1) may call in; nothing here calls out.
"""

from __future__ import annotations

from typing import NamedTuple

from sortedcontainers import SortedDict, SortedList

from embcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    NotAllocatedError,
)
from embcache.locks import ALLOCATOR_LEVEL, HierarchyLock


class Block(NamedTuple):
    """One block of the partition: ``[offset, offset + size)``."""

    offset: int
    size: int
    free: bool


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (a power of two).

    pre: nbytes >= 0
    pre: alignment > 0 and alignment & (alignment - 1) == 0
    post: __return__ % alignment == 0
    post: nbytes <= __return__ < nbytes + alignment
    """
    return (nbytes + alignment - 1) & ~(alignment - 1)


class RangeAllocator:
    """Best-fit allocator of aligned byte ranges in ``[0, capacity)``.

    inv: 0 <= self._allocated_bytes <= self._capacity
    inv: self._allocated_bytes % self._alignment == 0
    """

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        _check_int("capacity", capacity)
        _check_int("alignment", alignment)
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgumentError(f"alignment must be a power of two > 0, got {alignment}")
        if capacity <= 0:
            raise InvalidArgumentError(f"capacity must be > 0, got {capacity}")
        if capacity % alignment:
            raise InvalidArgumentError(
                f"capacity {capacity} must be a multiple of the alignment {alignment}"
            )
        self._capacity = capacity
        self._alignment = alignment
        self._lock = HierarchyLock(ALLOCATOR_LEVEL, "allocator lock")
        self._free_by_offset: SortedDict = SortedDict({0: capacity})
        self._free_by_size: SortedList = SortedList([(capacity, 0)])
        self._allocated: SortedDict = SortedDict()
        self._allocated_bytes = 0

    @property
    def capacity(self) -> int:
        """Size of the managed buffer in bytes. O(1)."""
        return self._capacity

    @property
    def alignment(self) -> int:
        """Every size is rounded up to, and every offset is, a multiple of this. O(1)."""
        return self._alignment

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks (after rounding). O(1)."""
        return self._allocated_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes in free blocks. O(1)."""
        return self._capacity - self._allocated_bytes

    @property
    def largest_free_block(self) -> int:
        """Size of the largest free block, 0 when full. O(log n)."""
        with self._lock:
            return int(self._free_by_size[-1][0]) if self._free_by_size else 0

    def rounded(self, nbytes: int) -> int:
        """The size ``allocate(nbytes)`` would reserve; raises like ``allocate`` on bad input.

        raises: InvalidArgumentError, InvalidTypeError
        post: __return__ % self.alignment == 0 and nbytes <= __return__
        """
        self._check_size(nbytes)
        return align_up(nbytes, self._alignment)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new range of ``nbytes`` (rounded up); None if no block fits. O(log n).

        raises: InvalidArgumentError, InvalidTypeError
        post: __return__ is None or __return__ % self.alignment == 0
        post: __return__ is None or __return__ + nbytes <= self.capacity
        """
        size = self.rounded(nbytes)
        with self._lock:
            index = self._free_by_size.bisect_left((size, -1))
            if index == len(self._free_by_size):
                return None
            block_size, offset = self._free_by_size.pop(index)
            del self._free_by_offset[offset]
            if block_size > size:
                self._add_free(offset + size, block_size - size)
            self._allocated[offset] = size
            self._allocated_bytes += size
            return int(offset)

    def free(self, offset: int) -> int:
        """Free the range starting at ``offset``; returns its size. O(log n).

        raises: NotAllocatedError, InvalidTypeError
        post: __return__ > 0 and __return__ % self.alignment == 0
        post: self.allocated_bytes == __old__.self.allocated_bytes - __return__
        """
        _check_int("offset", offset)
        with self._lock:
            size = self._allocated.pop(offset, None)
            if size is None:
                raise NotAllocatedError(self._not_allocated_message(offset))
            self._allocated_bytes -= size
            start, end = offset, offset + size
            before = self._free_by_offset.bisect_left(start) - 1
            if before >= 0:
                prev_offset, prev_size = self._free_by_offset.peekitem(before)
                if prev_offset + prev_size == start:
                    self._remove_free(prev_offset, prev_size)
                    start = prev_offset
            next_size = self._free_by_offset.get(end)
            if next_size is not None:
                self._remove_free(end, next_size)
                end += next_size
            self._add_free(start, end - start)
            return int(size)

    def size_of(self, offset: int) -> int:
        """Size of the live allocation starting at ``offset``. O(1).

        raises: NotAllocatedError, InvalidTypeError
        """
        _check_int("offset", offset)
        with self._lock:
            size = self._allocated.get(offset)
            if size is None:
                raise NotAllocatedError(self._not_allocated_message(offset))
            return int(size)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as ``(offset, size)`` in address order. O(n)."""
        with self._lock:
            return [(int(o), int(s)) for o, s in self._free_by_offset.items()]

    def allocations(self) -> list[tuple[int, int]]:
        """Every allocated block as ``(offset, size)`` in address order. O(n)."""
        with self._lock:
            return [(int(o), int(s)) for o, s in self._allocated.items()]

    def block_before(self, offset: int) -> Block | None:
        """The block that ends at ``offset`` (a block boundary), or None at 0. O(log n)."""
        with self._lock:
            candidates = []
            for index, free in ((self._free_by_offset, True), (self._allocated, False)):
                i = index.bisect_left(offset) - 1
                if i >= 0:
                    o, s = index.peekitem(i)
                    candidates.append(Block(int(o), int(s), free))
            best = max(candidates, default=None)
            return best if best is not None and best.offset + best.size == offset else None

    def block_at(self, offset: int) -> Block | None:
        """The block that starts at ``offset``, or None. O(1)."""
        with self._lock:
            size = self._free_by_offset.get(offset)
            if size is not None:
                return Block(offset, int(size), True)
            size = self._allocated.get(offset)
            return None if size is None else Block(offset, int(size), False)

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant. O(n log n)."""
        with self._lock:
            self._check_invariants_locked()

    def _check_invariants_locked(self) -> None:
        def fail(what: str) -> None:
            raise InvariantError(
                f"allocator invariant broken: {what}; free_by_offset={dict(self._free_by_offset)} "
                f"free_by_size={list(self._free_by_size)} allocated={dict(self._allocated)} "
                f"allocated_bytes={self._allocated_bytes} capacity={self._capacity}"
            )

        if sorted(self._free_by_size) != sorted((s, o) for o, s in self._free_by_offset.items()):
            fail("the size index and the offset index of free blocks disagree")
        blocks = sorted(
            [(o, s, True) for o, s in self._free_by_offset.items()]
            + [(o, s, False) for o, s in self._allocated.items()]
        )
        cursor, previous_free = 0, False
        for offset, size, free in blocks:
            if offset != cursor:
                fail(f"block at {offset} does not start where the previous ends ({cursor})")
            if size <= 0 or size % self._alignment or offset % self._alignment:
                fail(f"block ({offset}, {size}) is empty or not aligned")
            if free and previous_free:
                fail(f"free block at {offset} touches the previous free block (not coalesced)")
            cursor, previous_free = offset + size, free
        if cursor != self._capacity:
            fail(f"blocks end at {cursor}, not at the capacity")
        if self._allocated_bytes != sum(self._allocated.values()):
            fail("allocated_bytes differs from the sum of allocated blocks")

    def _check_size(self, nbytes: int) -> None:
        _check_int("nbytes", nbytes)
        if nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
        if nbytes > self._capacity:
            raise InvalidArgumentError(
                f"nbytes {nbytes} exceeds the capacity {self._capacity}: it can never fit"
            )

    def _add_free(self, offset: int, size: int) -> None:
        self._free_by_offset[offset] = size
        self._free_by_size.add((size, offset))

    def _remove_free(self, offset: int, size: int) -> None:
        del self._free_by_offset[offset]
        self._free_by_size.remove((size, offset))

    def _not_allocated_message(self, offset: int) -> str:
        return (
            f"offset {offset} is not the start of a live allocation (double free, interior "
            "offset, or never allocated)"
        )

    def __repr__(self) -> str:
        return (
            f"RangeAllocator(capacity={self._capacity}, alignment={self._alignment}, "
            f"allocated_bytes={self._allocated_bytes}, free_blocks={len(self._free_by_offset)})"
        )
