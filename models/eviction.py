"""Reference of ``embcache.core.eviction.choose_victims``: the rule as first written (issue 14).

For each k (the k first candidates of the eviction order), walk the allocator's blocks around
the k-th candidate and search that neighbourhood for the best window; the first k with a window
wins. Obviously the rule of DESIGN.md ("Eviction that respects contiguity"), and O(k * max_batch)
allocator walks and window searches per call: ``embcache.core.eviction`` must choose exactly the
same victims while searching only the run of available space that first reaches the size asked
for. Kept verbatim, so that the equivalence test compares against the code that ran before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from embcache.allocator import Block
from embcache.core.eviction import Piece, Window


def best_window(pieces: list[Piece], need: int, max_batch: int, must: int) -> Window | None:
    """Best run of victims containing ``pieces[must]`` whose freed span holds ``need`` bytes.

    ``pieces`` are contiguous, in address order, free pieces never adjacent to each other; the
    blocks just outside the list are not evicted. Cost O(max_batch^2) at worst, usually O(1).

    pre: need > 0 and max_batch > 0 and all(p.size > 0 for p in pieces)
    pre: 0 <= must < len(pieces) and pieces[must].victim
    pre: all(a.offset + a.size == b.offset for a, b in zip(pieces, pieces[1:]))
    post: __return__ is None or len(__return__.victims) <= max_batch
    post: __return__ is None or __return__.span >= need
    post: __return__ is None or pieces[must].offset in __return__.victims
    """
    victims = [p for p in pieces if p.victim]
    index_of_must = victims.index(pieces[must])
    first_start, last_end = pieces[0].offset, pieces[-1].offset + pieces[-1].size

    def span_start(a: int) -> int:
        return victims[a - 1].offset + victims[a - 1].size if a > 0 else first_start

    def span_end(b: int) -> int:
        return victims[b + 1].offset if b + 1 < len(victims) else last_end

    for count in range(1, max_batch + 1):
        best: Window | None = None
        for a in range(max(0, index_of_must - count + 1), index_of_must + 1):
            b = a + count - 1
            if b >= len(victims):
                break
            start, end = span_start(a), span_end(b)
            if end - start < need:
                continue
            chosen = victims[a : b + 1]
            window = Window(
                tuple(v.offset for v in chosen), sum(v.size for v in chosen), start, end - start
            )
            if best is None or (window.victim_bytes, window.offset) < (
                best.victim_bytes,
                best.offset,
            ):
                best = window
        if best is not None:
            return best
    return None


def neighbourhood(
    candidate: Block,
    max_batch: int,
    block_before: Callable[[int], Block | None],
    block_at: Callable[[int], Block | None],
    is_candidate: Callable[[int], bool],
) -> tuple[list[Piece], int]:
    """Pieces around ``candidate``: up to ``max_batch - 1`` candidates each side, plus free gaps.

    Returns the pieces in address order and the index of ``candidate`` among them.
    """

    def usable(block: Block | None) -> Piece | None:
        if block is None:
            return None
        if block.free:
            return Piece(block.offset, block.size, False)
        if is_candidate(block.offset):
            return Piece(block.offset, block.size, True)
        return None

    left: list[Piece] = []
    victims, cursor = 0, candidate.offset
    while (piece := usable(block_before(cursor))) is not None:
        if piece.victim:
            if victims == max_batch - 1:
                break
            victims += 1
        left.append(piece)
        cursor = piece.offset
    right: list[Piece] = []
    victims, cursor = 0, candidate.offset + candidate.size
    while (piece := usable(block_at(cursor))) is not None:
        if piece.victim:
            if victims == max_batch - 1:
                break
            victims += 1
        right.append(piece)
        cursor = piece.offset + piece.size
    left.reverse()
    return [*left, Piece(candidate.offset, candidate.size, True), *right], len(left)


def choose_victims(
    need: int,
    lru: Iterable[Block],
    max_batch: int,
    block_before: Callable[[int], Block | None],
    block_at: Callable[[int], Block | None],
) -> Window | None:
    """The eviction rule of DESIGN.md over candidates in LRU order; None when nothing can work.

    Cost: O(k * max_batch * log n) for the k candidates examined, never all entries.
    """
    candidates: set[int] = set()
    for block in lru:
        candidates.add(block.offset)
        pieces, must = neighbourhood(
            block, max_batch, block_before, block_at, candidates.__contains__
        )
        window = best_window(pieces, need, max_batch, must)
        if window is not None:
            return window
    return None
