"""Best-fit byte-range allocator over one buffer ``[0, capacity)``; it owns no memory.

Theory of operation: the buffer is partitioned into blocks, each free or allocated. Every
block is indexed by its start (``_free`` or ``_allocated``: start -> end) and by its end
(``_end``: end -> start), so the blocks on both sides of a boundary are found in O(1); free
blocks are also kept in one ``SortedList`` ordered by ``(size, offset)`` (to find the best
fit), each encoded as one int, ``size_units * capacity_units + offset_units``: ints compare
faster than tuples, and the order is the same. Sizes are rounded up to the alignment, so every
block boundary is a multiple of it. ``allocate`` takes the smallest free block that fits
(lowest offset among equal sizes) and carves the allocation from its start; ``free`` merges
the block with free neighbours on both sides, so the free list is always fully coalesced.
Same calls, same offsets: a reference model can predict every result.

Not thread-safe: ``BestFitAllocator`` takes no lock; its owner serializes the calls (the core
runs under the cache lock). ``embcache.driver.allocator.RangeAllocator``, the public one, is the
same allocator behind its own lock.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mypy_extensions import mypyc_attr
from sortedcontainers import SortedList

from embcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    NotAllocatedError,
)


class Block(NamedTuple):
    """One block of the partition: ``[offset, offset + size)``."""

    offset: int
    size: int
    free: bool


_new_block = tuple.__new__  # Block(...) without the namedtuple's Python-level __new__ (hot path)


def check_int(name: str, value: object) -> int:
    """``value``, or ``InvalidTypeError`` naming ``name`` when it is not an int (bool is not)."""
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


@mypyc_attr(allow_interpreted_subclasses=True)  # the compiled core: RangeAllocator extends it
class BestFitAllocator:
    """Best-fit allocator of aligned byte ranges in ``[0, capacity)``; no lock (see above).

    inv: 0 <= self._allocated_bytes <= self._capacity
    inv: self._allocated_bytes % self._alignment == 0
    """

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        check_int("capacity", capacity)
        check_int("alignment", alignment)
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
        self._shift = alignment.bit_length() - 1
        self._units = capacity >> self._shift  # the size index: size_units * _units + offset_units
        self._free: dict[int, int] = {0: capacity}  # start -> end
        self._allocated: dict[int, int] = {}  # start -> end
        self._end: dict[int, int] = {capacity: 0}  # end -> start, of every block
        self._free_by_size: SortedList = SortedList([self._units * self._units])
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
        """Size of the largest free block, 0 when full. O(1)."""
        if not self._free_by_size:
            return 0
        largest: int = self._free_by_size[-1]
        return largest // self._units << self._shift

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
        if type(nbytes) is not int or not 0 < nbytes <= self._capacity:
            self._check_size(nbytes)  # raises, unless an int subclass in range
        size = (nbytes + self._alignment - 1) & -self._alignment
        shift, units = self._shift, self._units
        by_size = self._free_by_size
        index = by_size.bisect_left((size >> shift) * units)
        if index == len(by_size):
            return None
        key: int = by_size.pop(index)
        # One int object per boundary, shared by the maps, saves memory (32 B a boundary, up
        # to 3 a block). Read through ``Any`` so that the compiled build keeps them boxed too:
        # an ``int`` read is unboxed there and boxed anew on each store (596 B of metadata an
        # entry at 100k entries, not 508).
        free: dict[int, Any] = self._free
        ends: dict[int, Any] = self._end
        end = free.pop((key % units) << shift)
        offset = ends[end]
        middle = offset + size
        self._allocated[offset] = middle
        if middle < end:
            free[middle] = end
            ends[middle] = offset
            ends[end] = middle
            by_size.add(((end - middle) >> shift) * units + (middle >> shift))
        self._allocated_bytes += size
        allocated: int = offset
        return allocated

    def free(self, offset: int) -> int:
        """Free the range starting at ``offset``; returns its size. O(log n).

        raises: NotAllocatedError, InvalidTypeError
        post: __return__ > 0 and __return__ % self.alignment == 0
        post: self.allocated_bytes == __old__.self.allocated_bytes - __return__
        """
        if type(offset) is not int:
            check_int("offset", offset)
        shift, units = self._shift, self._units
        free, ends, by_size = self._free, self._end, self._free_by_size
        end = self._allocated.pop(offset, None)
        if end is None:
            raise NotAllocatedError(self._not_allocated_message(offset))
        size = end - offset
        self._allocated_bytes -= size
        start = offset
        before = ends.get(start)
        if before is not None and before in free:
            del free[before], ends[start]
            by_size.remove(((start - before) >> shift) * units + (before >> shift))
            start = before
        after = free.pop(end, None)
        if after is not None:
            del ends[end]
            by_size.remove(((after - end) >> shift) * units + (end >> shift))
            end = after
        free[start] = end
        ends[end] = start
        by_size.add(((end - start) >> shift) * units + (start >> shift))
        return size

    def size_of(self, offset: int) -> int:
        """Size of the live allocation starting at ``offset``. O(1).

        raises: NotAllocatedError, InvalidTypeError
        """
        check_int("offset", offset)
        end = self._allocated.get(offset)
        if end is None:
            raise NotAllocatedError(self._not_allocated_message(offset))
        return end - offset

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as ``(offset, size)`` in address order. O(n log n)."""
        return [(start, end - start) for start, end in sorted(self._free.items())]

    def allocations(self) -> list[tuple[int, int]]:
        """Every allocated block as ``(offset, size)`` in address order. O(n log n)."""
        return [(start, end - start) for start, end in sorted(self._allocated.items())]

    def block_before(self, offset: int) -> Block | None:
        """The block that ends at ``offset`` (a block boundary), or None at 0. O(1)."""
        start = self._end.get(offset)
        free = start in self._free
        return None if start is None else _new_block(Block, (start, offset - start, free))

    def block_at(self, offset: int) -> Block | None:
        """The block that starts at ``offset``, or None. O(1)."""
        end = self._free.get(offset)
        free = end is not None
        if not free:
            end = self._allocated.get(offset)
        return None if end is None else _new_block(Block, (offset, end - offset, free))

    def free_around(self, offset: Any, end: Any) -> tuple[Any, Any]:
        """``(start, stop)``: ``[offset, end)`` (two ints) widened over the free block that
        ends at ``offset`` and the free block that starts at ``end``, where there are such
        blocks (the eviction rule's one query per candidate). O(1)."""
        # Ints typed ``Any`` (as ``allocate`` reads its maps): the compiled build takes the
        # caller's boxed ints and hands back those or the maps' own, boxing none (typed ``int``,
        # each call boxed both arguments and its caller both results again: 4 int objects a
        # candidate of the eviction search, which keeps them as dict keys).
        free: dict[int, Any] = self._free
        before: Any = self._end.get(offset)
        after: Any = free.get(end)
        start: Any = offset
        stop: Any = end
        if before is not None and before in free:
            start = before
        if after is not None:
            stop = after
        return start, stop

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant. O(n log n)."""
        check_blocks(
            self._free, self._allocated, self._end, list(self._free_by_size),
            self._allocated_bytes, self._capacity, self._alignment,
        )  # fmt: skip

    def _check_size(self, nbytes: int) -> None:
        check_int("nbytes", nbytes)
        if nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be > 0, got {nbytes}")
        if nbytes > self._capacity:
            raise InvalidArgumentError(
                f"nbytes {nbytes} exceeds the capacity {self._capacity}: it can never fit"
            )

    def _not_allocated_message(self, offset: int) -> str:
        return (
            f"offset {offset} is not the start of a live allocation (double free, interior "
            "offset, or never allocated)"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, alignment={self._alignment}, "
            f"allocated_bytes={self._allocated_bytes}, free_blocks={len(self._free)})"
        )


def size_key(start: int, end: int, capacity: int, alignment: int) -> int:
    """A free block's key in the size index: by size, then by offset (in alignment units)."""
    shift = alignment.bit_length() - 1
    return ((end - start) >> shift) * (capacity >> shift) + (start >> shift)


def check_blocks(
    free: dict[int, int], allocated: dict[int, int], end: dict[int, int],
    free_by_size: list[int], allocated_bytes: int, capacity: int, alignment: int,
) -> None:  # fmt: skip
    """Raise ``InvariantError`` naming the first broken invariant of an allocator's indexes
    (``free`` and ``allocated``: start -> end; ``end``: end -> start of every block;
    ``free_by_size``: the free blocks' ``size_key``s in order), given explicitly so that a
    test can check corrupted copies. O(n log n)."""

    def fail(what: str) -> None:
        raise InvariantError(
            f"allocator invariant broken: {what}; free={dict(sorted(free.items()))} "
            f"allocated={dict(sorted(allocated.items()))} "
            f"end={dict(sorted(end.items()))} free_by_size={free_by_size} "
            f"allocated_bytes={allocated_bytes} capacity={capacity}"
        )

    if set(free) & set(allocated):
        fail("a block is both free and allocated")
    keys = sorted(size_key(s, e, capacity, alignment) for s, e in free.items())
    if keys != free_by_size:
        fail("the size index and the offset index of free blocks disagree")
    starts = {**free, **allocated}
    if end != {stop: start for start, stop in starts.items()}:
        fail("the end index disagrees with the blocks")
    blocks = sorted([(s, e - s, True) for s, e in free.items()])
    blocks += [(s, e - s, False) for s, e in allocated.items()]
    blocks.sort()
    cursor, previous_free = 0, False
    for offset, size, is_free in blocks:
        if offset != cursor:
            fail(f"block at {offset} does not start where the previous ends ({cursor})")
        if size <= 0 or size % alignment or offset % alignment:
            fail(f"block ({offset}, {size}) is empty or not aligned")
        if is_free and previous_free:
            fail(f"free block at {offset} touches the previous free block (not coalesced)")
        cursor, previous_free = offset + size, is_free
    if cursor != capacity:
        fail(f"blocks end at {cursor}, not at the capacity")
    if allocated_bytes != sum(e - s for s, e in allocated.items()):
        fail("allocated_bytes differs from the sum of allocated blocks")
