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
stretch of free blocks and candidates around it. So ``VictimSearch`` keeps the runs as
candidates arrive (one dict, start -> end and end -> start: adding a candidate merges it with
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
allocator's blocks around a candidate, through free blocks and candidates only. The core feeds
``VictimSearch`` its eviction order in a typed loop (no generator, no block per candidate);
``choose_victims`` is the same search over any iterable of blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

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


class VictimSearch:
    """The eviction rule of DESIGN.md, fed one candidate at a time in eviction order (lowest
    value first): ``add`` returns the chosen window as soon as one exists, else None.

    Given a ``BestFitAllocator`` its own ``free_around`` answers both sides of a candidate in
    one call; other block queries (tests, models) get the same answer from two calls.
    Cost: O(1) dict operations and one ``free_around`` a candidate, plus one walk of at most
    ``2 * max_batch`` blocks and one window search each time a merged run spans ``need``.
    """

    def __init__(
        self,
        need: int,
        max_batch: int,
        block_before: Callable[[int], Block | None],
        block_at: Callable[[int], Block | None],
        allocator: BestFitAllocator | None = None,
    ) -> None:
        self._need = need
        self._max_batch = max_batch
        self._block_before = block_before
        self._block_at = block_at
        self._allocator = allocator  # when set, block_before/block_at are its own methods
        self._free_around = free_around_by_blocks(block_before, block_at)
        # Both edges of each run of free blocks and candidates: start -> end and end -> start.
        # One dict serves both: no two runs touch (they would have merged), and no run starts
        # or ends inside a new candidate, so a candidate's own start can only be a run's end,
        # and its end only a run's start.
        self._edges: dict[int, int] = {}

    @classmethod
    def over(cls, need: int, max_batch: int, allocator: BestFitAllocator) -> VictimSearch:
        """A search over ``allocator``'s blocks."""
        return cls(need, max_batch, allocator.block_before, allocator.block_at, allocator)

    def add(self, offset: int, size: int) -> Window | None:
        """The next candidate, the block ``[offset, offset + size)``; the window once feasible."""
        end = offset + size
        # The dict is read and written through ``Any`` names: the compiled build then makes one
        # int object per edge and reuses it, instead of boxing an int for every dict operation.
        edges: dict[int, Any] = self._edges
        key: Any = offset
        key_end: Any = end
        left: Any = edges.get(key)  # the start of a run that ends where the block starts
        right: Any = edges.get(key_end)  # the end of a run that starts where the block ends
        free_start = free_stop = 0
        if left is None or right is None:
            allocator = self._allocator
            if allocator is not None:
                free_start, free_stop = allocator.free_around(offset, end)
            else:
                free_start, free_stop = self._free_around(offset, end)
        start_edge: Any = free_start if left is None else left
        stop_edge: Any = free_stop if right is None else right
        if left is not None:
            del edges[key]
        if right is not None:
            del edges[key_end]
        edges[start_edge] = stop_edge
        edges[stop_edge] = start_edge
        start: int = start_edge
        stop: int = stop_edge
        if stop - start < self._need:
            return None
        if left is None and right is None:  # no other candidate beside it: one window
            return Window((offset,), size, start, stop - start)
        inside = range(start, stop).__contains__  # the run's allocated blocks: candidates
        pieces, must = neighbourhood(
            Block(offset, size, False),
            self._max_batch,
            self._block_before,
            self._block_at,
            inside,
        )
        return best_window(pieces, self._need, self._max_batch, must)


def choose_victims(
    need: int,
    candidates: Iterable[Block],
    max_batch: int,
    block_before: Callable[[int], Block | None],
    block_at: Callable[[int], Block | None],
) -> Window | None:
    """The eviction rule of DESIGN.md over ``candidates`` in eviction order (lowest value
    first); None when nothing can work. (``VictimSearch`` fed each candidate in turn.)
    Cost: O(k) for the k candidates examined (never all entries), as ``VictimSearch.add``.
    """
    owner = getattr(block_before, "__self__", None)
    allocator = None
    if (
        isinstance(owner, BestFitAllocator)
        and block_before == owner.block_before
        and block_at == owner.block_at
    ):
        allocator = owner
    search = VictimSearch(need, max_batch, block_before, block_at, allocator)
    for block in candidates:
        window = search.add(block[0], block[1])
        if window is not None:
            return window
    return None
