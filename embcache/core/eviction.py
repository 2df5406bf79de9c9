"""Victim selection that respects contiguity (DESIGN.md, "Eviction that respects contiguity").

Design notes. Plain LRU frees the oldest entries until enough bytes are free; when the freed
holes are not adjacent the allocation fails anyway and the evictions were for nothing. Here
candidates are added in eviction order (lowest value first); after adding the k-th, we ask
whether a contiguous run made only of free blocks and candidates can hold the request with at
most ``max_batch`` victims. The first k for which one exists is the smallest such k, and every
feasible run at that k contains the k-th candidate (any run without it already existed at
k - 1). So only the neighbourhood of the newest candidate is examined: at most ``max_batch - 1``
candidates on each side. Among the feasible runs we take the fewest victims, then the fewest
victim bytes, then the lowest offset. Evicting exactly those leaves one free block (the span)
that the best-fit allocator must then choose, since no other free block fits.

Cost. A window never spans more than the *run of available space* it lies in: the maximal
stretch of free blocks and candidates around it. So ``choose_victims`` keeps the runs as
candidates arrive (two dicts, start -> end and end -> start: adding a candidate merges it with
the runs that end where it starts and start where it ends, or else with a free block beside it,
which no run can hold yet, since free blocks are coalesced and a run swallows the free blocks
beside its candidates), and searches only when the newest candidate's run spans ``need`` bytes:
a run that spans less holds no feasible window. A candidate alone in its run (no other
candidate beside it) has one window, itself and the free blocks beside it, known without a
search. Each candidate costs O(1) dict operations and at most one O(1) allocator query
(``BestFitAllocator.free_around``: the free blocks on both sides), as plain LRU's victims do;
only a run that merged candidates and spans ``need`` pays for the walk and the window search,
and in that walk a block is a candidate exactly when it lies inside the run.
``models.eviction`` reads the rule of DESIGN.md literally, by brute force and with no code in
common with this module; a test compares the two.

``best_window`` is the pure core (CrossHair checks its contract); ``neighbourhood`` walks the
allocator's blocks around a candidate, through free blocks and candidates only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from embcache.core.allocator import BestFitAllocator, Block


class Piece(NamedTuple):
    """A block of a run: free, or an eviction candidate."""

    offset: int
    size: int
    victim: bool


class Window(NamedTuple):
    """A feasible choice: evict ``victims``; the freed span starts at ``offset``."""

    victims: tuple[int, ...]  # offsets of the victims, in address order
    victim_bytes: int
    offset: int
    span: int


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


def free_around_by_blocks(
    block_before: Callable[[int], Block | None], block_at: Callable[[int], Block | None]
) -> Callable[[int, int], tuple[int, int]]:
    """``BestFitAllocator.free_around`` made of the two block queries: ``[offset, end)`` widened
    over the free blocks on both sides."""

    def free_around(offset: int, end: int) -> tuple[int, int]:
        before, after = block_before(offset), block_at(end)
        start = before[0] if before is not None and before[2] else offset
        return start, end + after[1] if after is not None and after[2] else end

    return free_around


def choose_victims(
    need: int,
    candidates: Iterable[Block],
    max_batch: int,
    block_before: Callable[[int], Block | None],
    block_at: Callable[[int], Block | None],
) -> Window | None:
    """The eviction rule of DESIGN.md over ``candidates`` in eviction order (lowest value
    first); None when nothing can work.

    When both queries are one ``BestFitAllocator``'s own methods, its ``free_around`` answers
    both sides of a candidate in one call (the same answer, half the calls).
    Cost: O(k) for the k candidates examined (never all entries), plus one walk of at most
    ``2 * max_batch`` blocks and one window search each time a merged run spans ``need``.
    """
    free_around: Callable[[int, int], tuple[int, int]]
    owner = getattr(block_before, "__self__", None)
    if (
        isinstance(owner, BestFitAllocator)
        and block_before == owner.block_before
        and block_at == owner.block_at
    ):
        free_around = owner.free_around
    else:
        free_around = free_around_by_blocks(block_before, block_at)
    run_end: dict[int, int] = {}  # start -> end of each run of free blocks and candidates
    run_start: dict[int, int] = {}  # end -> start
    for block in candidates:
        offset, size, _ = block
        end = offset + size
        left = run_start.pop(offset, None)  # the start of a run that ends where block starts
        right = run_end.pop(end, None)  # the end of a run that starts where block ends
        if left is None or right is None:
            free_start, free_stop = free_around(offset, end)
        if left is None:
            start = free_start
        else:
            start = left
            del run_end[left]
        if right is None:
            stop = free_stop
        else:
            stop = right
            del run_start[right]
        run_end[start] = stop
        run_start[stop] = start
        if stop - start < need:
            continue
        if left is None and right is None:  # no other candidate beside it: one window
            return Window((offset,), size, start, stop - start)
        inside = range(start, stop).__contains__  # the run's allocated blocks: candidates
        pieces, must = neighbourhood(block, max_batch, block_before, block_at, inside)
        window = best_window(pieces, need, max_batch, must)
        if window is not None:
            return window
    return None
