"""Copies split over helper threads (``embcache.driver.parallel_copy``): every byte lands, on
both sides of the threshold, of a chunk's edge and of the tail's; the chunks tile the range
once and the last ones are small (``plan``: a thread out of chunks waits for short ones);
``copy_bytes`` splits exactly from
``SPLIT_BYTES``; a chunk that raises makes the copy raise after the other chunks end, and an
insert whose copy raises so leaves its entry out of the cache (ABSENT), as a copy that raises
in one piece does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, Item
from embcache.core.lifecycle import ABSENT, READY
from embcache.driver import parallel_copy, pool
from embcache.driver.parallel_copy import (
    CHUNK_BYTES,
    HELPERS,
    SPLIT_BYTES,
    TAIL_BYTES,
    plan,
    split_copy,
)

SIZES = [
    1,
    CHUNK_BYTES - 1,
    CHUNK_BYTES,
    CHUNK_BYTES + 1,
    SPLIT_BYTES - 1,
    SPLIT_BYTES,
    SPLIT_BYTES + 1,
    3 * SPLIT_BYTES + 4097,
    2 * (HELPERS + 1) * CHUNK_BYTES + TAIL_BYTES - 1,  # where the tail starts, and past it
    2 * (HELPERS + 1) * CHUNK_BYTES + TAIL_BYTES + 1,
    SPLIT_BYTES + 3 * TAIL_BYTES // 2 + 7,
]


def noise(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("nbytes", SIZES)
def test_every_byte_lands_and_none_beside(nbytes: int) -> None:
    for copy in (split_copy, pool.copy_bytes):
        source = noise(nbytes, nbytes)
        target = torch.full((nbytes + 2,), 7, dtype=torch.uint8)
        copy(target.data_ptr() + 1, source.data_ptr(), nbytes)
        assert torch.equal(target[1:-1], source)
        assert target[0].item() == 7 and target[-1].item() == 7


@pytest.mark.parametrize("nbytes", [SPLIT_BYTES - 1, SPLIT_BYTES, SPLIT_BYTES + 1])
def test_copy_bytes_splits_from_the_threshold(nbytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    split: list[int] = []

    def spy(dst: int, src: int, size: int) -> None:
        split.append(size)
        split_copy(dst, src, size)

    monkeypatch.setattr(parallel_copy, "split_copy", spy)
    source, target = noise(nbytes, 1), torch.zeros(nbytes, dtype=torch.uint8)
    pool.copy_bytes(target.data_ptr(), source.data_ptr(), nbytes)
    assert torch.equal(target, source)
    assert split == ([nbytes] if nbytes >= SPLIT_BYTES else [])


def tiles(chunks: list[tuple[int, int]], nbytes: int) -> bool:
    """Whether (start, size) chunks, in order, cover ``[0, nbytes)`` once."""
    ends = [start + size for start, size in chunks]
    return [start for start, _ in chunks] == [0, *ends[:-1]] and ends[-1] == nbytes


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("nbytes", SIZES)
def test_the_plan_tiles_the_range_and_its_tail_shrinks(nbytes: int, threads: int) -> None:
    full, tail = plan(nbytes, threads)
    chunks = [(i * CHUNK_BYTES, CHUNK_BYTES) for i in range(full)] + tail
    assert tiles(chunks, nbytes)
    assert all(0 < size <= CHUNK_BYTES for _, size in chunks)
    assert sum(size for _, size in tail) <= 2 * threads * CHUNK_BYTES  # the tail, no more
    sizes = [size for _, size in tail[:-1]]
    assert sizes == sorted(sizes, reverse=True)  # shrinking; the last takes the remainder
    if nbytes >= 2 * threads * CHUNK_BYTES:
        assert all(size < 2 * TAIL_BYTES for _, size in tail[-threads:])


def test_a_split_copy_ends_on_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the helpers and the caller copy them: the last ``HELPERS + 1`` chunks are each
    under ``2 * TAIL_BYTES``, so whoever runs out of chunks first waits for short ones."""
    nbytes = SPLIT_BYTES + 4099
    source, target = noise(nbytes, 5), torch.zeros(nbytes, dtype=torch.uint8)
    copied: list[tuple[int, int]] = []
    real = parallel_copy.memmove

    def move(dst: int, src: int, size: int) -> Any:
        copied.append((src - source.data_ptr(), size))  # (a list append: atomic)
        return real(dst, src, size)

    monkeypatch.setattr(parallel_copy, "memmove", move)
    split_copy(target.data_ptr(), source.data_ptr(), nbytes)
    assert torch.equal(target, source)
    copied.sort()
    assert tiles(copied, nbytes)
    assert all(size < 2 * TAIL_BYTES for _, size in copied[-(HELPERS + 1) :])


class ChunkFailed(RuntimeError):
    pass


def failing_at(source: torch.Tensor, chunk: int) -> Any:
    """``memmove`` that raises on the chunk ``chunk`` of a copy from ``source``."""
    real = parallel_copy.memmove

    def move(dst: int, src: int, size: int) -> Any:
        if src == source.data_ptr() + chunk * CHUNK_BYTES:
            raise ChunkFailed(f"injected failure in chunk {chunk}")
        return real(dst, src, size)

    return move


def test_a_chunk_that_raises_makes_the_copy_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    nbytes = 4 * SPLIT_BYTES
    source, target = noise(nbytes, 2), torch.zeros(nbytes, dtype=torch.uint8)
    monkeypatch.setattr(parallel_copy, "memmove", failing_at(source, 0))
    with pytest.raises(ChunkFailed):
        split_copy(target.data_ptr(), source.data_ptr(), nbytes)
    # every chunk but the failed one was copied before the error came back
    assert torch.equal(target[CHUNK_BYTES:], source[CHUNK_BYTES:])


def test_an_insert_whose_split_copy_raises_leaves_its_entry_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nbytes = 2 * SPLIT_BYTES
    small, large = noise(1024, 3), noise(nbytes, 4)
    items = [Item("small", (1024,), torch.uint8), Item("large", (nbytes,), torch.uint8)]
    with EmbeddingCache(4 * nbytes, pin_memory=False, io_workers=1) as cache:
        with monkeypatch.context() as patch:
            patch.setattr(parallel_copy, "memmove", failing_at(large, 1))
            with pytest.raises(ChunkFailed), cache.request("encoder") as request:
                request.insert(["small", "large"], [small, large], publish=False)
        assert cache.entry_state("small") is READY
        assert cache.entry_state("large") is ABSENT
        assert cache.stats().allocated_bytes == 1024
        with cache.request("retry") as request:
            assert request.insert(["large"], [large], publish=False) == [True]
            request.lookup(items, prefetch=False)
            views = request.embeddings()
            assert torch.equal(views[0], small) and torch.equal(views[1], large)
        cache.check_invariants()
