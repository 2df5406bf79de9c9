"""Unit tests of RangeAllocator: policy, coalescing, and every bad input leaving it unchanged."""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.core.allocator import check_blocks, size_key
from embcache.driver.allocator import Block, RangeAllocator
from embcache.errors import (
    EmbCacheError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    NotAllocatedError,
)


def snapshot(a: RangeAllocator) -> tuple[object, ...]:
    return (a.allocations(), a.free_blocks(), a.allocated_bytes, a.free_bytes, a.largest_free_block)


def test_sizes_round_up_and_offsets_are_aligned() -> None:
    a = RangeAllocator(4096, alignment=256)
    assert a.allocate(1) == 0
    assert a.size_of(0) == 256
    assert a.allocate(257) == 256
    assert a.size_of(256) == 512
    assert a.allocated_bytes == 768 and a.free_bytes == 4096 - 768
    a.check_invariants()


def test_best_fit_takes_smallest_block_then_lowest_offset() -> None:
    a = RangeAllocator(16 * 256, alignment=256)
    offs = [a.allocate(256) for _ in range(16)]
    # Free blocks of 2, 1, 1 units at 0, 768, 1536 (separated by live blocks).
    for o in (offs[0], offs[1], offs[3], offs[6]):
        a.free(o)
    assert a.free_blocks() == [(0, 512), (768, 256), (1536, 256)]
    assert a.allocate(256) == 768  # smallest fitting block, lowest offset among equals
    assert a.allocate(256) == 1536
    assert a.allocate(256) == 0  # only the 2-unit block is left; carve from its start
    a.check_invariants()


def test_free_coalesces_with_both_neighbours() -> None:
    a = RangeAllocator(3 * 256, alignment=256)
    x, y, z = a.allocate(256), a.allocate(256), a.allocate(256)
    a.free(x)
    a.free(z)
    assert a.free_blocks() == [(0, 256), (512, 256)]
    assert a.free(y) == 256
    assert a.free_blocks() == [(0, 768)]
    assert a.largest_free_block == 768
    a.check_invariants()


def test_full_allocator_returns_none_not_an_error() -> None:
    a = RangeAllocator(512, alignment=256)
    assert a.allocate(512) == 0
    assert a.allocate(1) is None
    assert a.largest_free_block == 0


def test_same_calls_give_same_offsets() -> None:
    def run() -> list[int | None]:
        a = RangeAllocator(1 << 16, alignment=64)
        out = []
        for i in range(200):
            out.append(a.allocate(64 * (1 + i % 7)))
            if i % 3 == 0 and out[i // 2] is not None:
                off = out[i // 2]
                assert off is not None
                with contextlib.suppress(NotAllocatedError):
                    a.free(off)
        return out

    assert run() == run()


def test_neighbour_queries() -> None:
    a = RangeAllocator(1024, alignment=256)
    x = a.allocate(256)
    assert x == 0
    assert a.block_before(0) is None
    assert a.block_at(0) == (0, 256, False)
    assert a.block_at(256) == (256, 768, True)
    assert a.block_before(256) == (0, 256, False)
    assert a.block_at(512) is None


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda a: a.allocate(0), InvalidArgumentError, "nbytes must be > 0, got 0"),
        (lambda a: a.allocate(-5), InvalidArgumentError, "nbytes must be > 0, got -5"),
        (lambda a: a.allocate(True), InvalidTypeError, "nbytes must be an int, got bool"),
        (lambda a: a.allocate(1.5), InvalidTypeError, "nbytes must be an int, got float"),
        (lambda a: a.allocate("8"), InvalidTypeError, "nbytes must be an int, got str"),
        (lambda a: a.allocate(4097), InvalidArgumentError, "exceeds the capacity 4096"),
        (lambda a: a.free(1024), NotAllocatedError, "offset 1024 is not the start"),  # double free
        (lambda a: a.free(256), NotAllocatedError, "offset 256 is not the start"),  # interior
        (lambda a: a.free(2048), NotAllocatedError, "never allocated"),
        (lambda a: a.free(None), InvalidTypeError, "offset must be an int, got NoneType"),
        (lambda a: a.size_of(3), NotAllocatedError, "offset 3 is not the start"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error, message) -> None:  # type: ignore[no-untyped-def]
    a = RangeAllocator(4096, alignment=256)
    a.allocate(1024)  # live block [0, 1024); 256 is interior
    freed = a.allocate(256)
    assert freed == 1024
    a.free(freed)  # freeing 1024 again is a double free
    before = snapshot(a)
    with pytest.raises(error, match=message) as info:
        call(a)
    assert isinstance(info.value, EmbCacheError)
    assert snapshot(a) == before
    a.check_invariants()


def test_double_free_after_real_free() -> None:
    a = RangeAllocator(1024, alignment=256)
    off = a.allocate(256)
    assert off is not None
    a.free(off)
    before = snapshot(a)
    with pytest.raises(NotAllocatedError, match="double free"):
        a.free(off)
    assert snapshot(a) == before


@pytest.mark.parametrize(
    ("capacity", "alignment", "error", "message"),
    [
        (0, 256, InvalidArgumentError, "capacity must be > 0, got 0"),
        (-256, 256, InvalidArgumentError, "capacity must be > 0"),
        (1024, 0, InvalidArgumentError, "alignment must be a power of two > 0, got 0"),
        (1024, 3, InvalidArgumentError, "power of two"),
        (1024, -4, InvalidArgumentError, "power of two"),
        (1000, 256, InvalidArgumentError, "multiple of the alignment 256"),
        (1024.0, 256, InvalidTypeError, "capacity must be an int"),
        (1024, True, InvalidTypeError, "alignment must be an int, got bool"),
    ],
)
def test_bad_construction(capacity, alignment, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        RangeAllocator(capacity, alignment)


def test_errors_also_derive_from_builtins() -> None:
    a = RangeAllocator(1024)
    with pytest.raises(ValueError):
        a.allocate(0)
    with pytest.raises(TypeError):
        a.allocate(1.0)  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        a.free(512)


def test_threads_never_hand_out_overlapping_ranges() -> None:
    a = RangeAllocator(1 << 20, alignment=256)
    seen: list[list[int]] = [[] for _ in range(4)]

    def worker(i: int) -> None:
        mine = []
        for n in range(500):
            off = a.allocate(256 * (1 + (n + i) % 5))
            if off is not None:
                mine.append(off)
            if len(mine) > 20:
                a.free(mine.pop(0))
        seen[i] = mine

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.check_invariants()
    live = sorted((o, a.size_of(o)) for s in seen for o in s)
    assert live == a.allocations()


def test_int_subclasses_are_sizes_and_offsets() -> None:
    class Units(int):
        pass

    a = RangeAllocator(1024, alignment=256)
    assert a.allocate(Units(300)) == 0
    assert a.size_of(0) == 512
    assert a.free(Units(0)) == 512
    a.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=16),
    freed=st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_neighbour_queries_match_the_block_list(sizes: list[int], freed: list[bool]) -> None:
    """block_before and block_at (O(1) through the start and end indexes) agree with the
    partition as free_blocks() and allocations() list it, at every multiple of the alignment."""
    a = RangeAllocator((sum(sizes) + 2) * 256, alignment=256)
    offsets = [a.allocate(size * 256) for size in sizes]
    for offset, free in zip(offsets, freed, strict=False):
        assert offset is not None
        if free:
            a.free(offset)
    a.check_invariants()
    blocks = sorted(
        [Block(o, s, True) for o, s in a.free_blocks()]
        + [Block(o, s, False) for o, s in a.allocations()]
    )
    starts = {b.offset: b for b in blocks}
    ends = {b.offset + b.size: b for b in blocks}
    for offset in range(0, a.capacity + 256, 256):
        assert a.block_at(offset) == starts.get(offset)
        assert a.block_before(offset) == ends.get(offset)
    assert a.largest_free_block == max((b.size for b in blocks if b.free), default=0)


def indexes_of(a: RangeAllocator) -> dict[str, Any]:
    """The allocator's indexes, rebuilt from its public block lists in the shape
    ``check_blocks`` takes (what ``check_invariants`` hands it)."""
    free = {o: o + n for o, n in a.free_blocks()}
    allocated = {o: o + n for o, n in a.allocations()}
    return {
        "free": free,
        "allocated": allocated,
        "end": {e: s for s, e in {**free, **allocated}.items()},
        "free_by_size": sorted(size_key(s, e, a.capacity, a.alignment) for s, e in free.items()),
        "allocated_bytes": a.allocated_bytes,
        "capacity": a.capacity,
        "alignment": a.alignment,
    }


def corrupted(corrupt: str) -> str:
    """The message of the allocator's invariant check after one corruption of its indexes
    (the first invariant it breaks: a block removed also leaves ``allocated_bytes`` stale,
    checked last)."""
    a = RangeAllocator(8 * 256, alignment=256)
    a.allocate(256)
    a.allocate(256)
    a.check_invariants()  # blocks: [0, 256) and [256, 512) allocated, [512, 2048) free
    index = indexes_of(a)
    check_blocks(**index)  # as built, the indexes pass
    free, allocated, end, by_size = (index[k] for k in ("free", "allocated", "end", "free_by_size"))
    if corrupt == "size_index":
        by_size.insert(0, 1)
    elif corrupt == "end_index":
        end[1024] = 512
    elif corrupt == "free_and_allocated":
        free[0] = 256
    elif corrupt == "not_coalesced":
        by_size.clear()
        free.clear()
        free.update({512: 1024, 1024: 2048})
        end.clear()
        end.update({256: 0, 512: 256, 1024: 512, 2048: 1024})
        by_size.extend([2 * 8 + 2, 4 * 8 + 4])
    elif corrupt == "gap":
        del allocated[0], end[256]
    elif corrupt == "unaligned":
        allocated[0] = 240
        end.clear()
        end.update({240: 0, 512: 256, 2048: 512})
    elif corrupt == "short":
        del free[512], end[2048]
        by_size.clear()
    elif corrupt == "allocated_bytes":
        index["allocated_bytes"] += 256
    with pytest.raises(InvariantError) as info:
        check_blocks(**index)
    return str(info.value)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        ("size_index", "the size index and the offset index of free blocks disagree"),
        ("end_index", "the end index disagrees with the blocks"),
        ("free_and_allocated", "a block is both free and allocated"),
        ("not_coalesced", r"free block at 1024 touches the previous free block \(not coalesced\)"),
        ("gap", r"block at 256 does not start where the previous ends \(0\)"),
        ("unaligned", r"block \(0, 240\) is empty or not aligned"),
        ("short", "blocks end at 512, not at the capacity"),
        ("allocated_bytes", "allocated_bytes differs from the sum of allocated blocks"),
    ],
)
def test_check_invariants_names_each_corruption(corrupt: str, message: str) -> None:
    got = corrupted(corrupt)
    assert re.fullmatch(
        f"allocator invariant broken: {message}; free=\\{{.*\\}} allocated=\\{{.*\\}} "
        r"end=\{.*\} free_by_size=\[.*\] allocated_bytes=\d+ capacity=2048",
        got,
    ), got
