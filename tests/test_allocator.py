"""Unit tests of RangeAllocator: policy, coalescing, and every bad input leaving it unchanged."""

from __future__ import annotations

import contextlib
import threading

import pytest

from embcache import RangeAllocator
from embcache.errors import EmbCacheError, InvalidArgumentError, InvalidTypeError, NotAllocatedError


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
