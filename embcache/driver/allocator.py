"""``RangeAllocator``: the best-fit allocator (``embcache.core.allocator``) behind its own lock.

The public, thread-safe allocator for use on its own: every call takes one internal lock, level 2
of the hierarchy (``embcache.driver.locks``); a caller holding the cache lock (level 1) may call in,
and nothing here calls out. The cache's core does not use it: it owns a ``BestFitAllocator`` that
the cache lock already serializes.

Every int argument is checked here, before the call reaches the core: in the compiled core
(docs/setup.md, "A compiled core") a method annotated ``int`` rejects anything else at its
boundary with a plain ``TypeError``, before its own check could raise ``InvalidTypeError``.
"""

from __future__ import annotations

from embcache.core.allocator import BestFitAllocator, Block, align_up, check_int
from embcache.driver.locks import ALLOCATOR_LEVEL, new_lock

__all__ = ["Block", "RangeAllocator", "align_up"]


class RangeAllocator(BestFitAllocator):
    """Best-fit allocator of aligned byte ranges in ``[0, capacity)``; thread-safe."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        super().__init__(check_int("capacity", capacity), check_int("alignment", alignment))
        self.lock = new_lock(ALLOCATOR_LEVEL, "allocator lock")  # level 2; only its methods take it

    @property
    def largest_free_block(self) -> int:
        """Size of the largest free block, 0 when full. O(1)."""
        with self.lock:
            return super().largest_free_block

    def rounded(self, nbytes: int) -> int:
        """The size ``allocate(nbytes)`` would reserve; raises like ``allocate`` on bad input."""
        return super().rounded(check_int("nbytes", nbytes))

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new range of ``nbytes`` (rounded up); None if no block fits. O(log n)."""
        if type(nbytes) is not int:
            check_int("nbytes", nbytes)
        with self.lock:
            return super().allocate(nbytes)

    def free(self, offset: int) -> int:
        """Free the range starting at ``offset``; returns its size. O(log n)."""
        if type(offset) is not int:
            check_int("offset", offset)
        with self.lock:
            return super().free(offset)

    def size_of(self, offset: int) -> int:
        """Size of the live allocation starting at ``offset``. O(1)."""
        if type(offset) is not int:
            check_int("offset", offset)
        with self.lock:
            return super().size_of(offset)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Every free block as ``(offset, size)`` in address order. O(n log n)."""
        with self.lock:
            return super().free_blocks()

    def allocations(self) -> list[tuple[int, int]]:
        """Every allocated block as ``(offset, size)`` in address order. O(n log n)."""
        with self.lock:
            return super().allocations()

    def block_before(self, offset: int) -> Block | None:
        """The block that ends at ``offset`` (a block boundary), or None at 0. O(1)."""
        if type(offset) is not int:
            check_int("offset", offset)
        with self.lock:
            return super().block_before(offset)

    def block_at(self, offset: int) -> Block | None:
        """The block that starts at ``offset``, or None. O(1)."""
        if type(offset) is not int:
            check_int("offset", offset)
        with self.lock:
            return super().block_at(offset)

    def free_around(self, offset: int, end: int) -> tuple[int, int]:
        """``BestFitAllocator.free_around`` under the lock. O(1)."""
        check_int("offset", offset)
        check_int("end", end)
        with self.lock:
            return super().free_around(offset, end)

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant. O(n log n)."""
        with self.lock:
            super().check_invariants()
