"""Copies split over helper threads (``embcache.driver.parallel_copy``): every byte lands, on
both sides of the threshold and of a chunk's edge; ``copy_bytes`` splits exactly from
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
from embcache.driver.parallel_copy import CHUNK_BYTES, SPLIT_BYTES, split_copy

SIZES = [
    1,
    CHUNK_BYTES - 1,
    CHUNK_BYTES,
    CHUNK_BYTES + 1,
    SPLIT_BYTES - 1,
    SPLIT_BYTES,
    SPLIT_BYTES + 1,
    3 * SPLIT_BYTES + 4097,
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
