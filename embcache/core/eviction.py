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

from array import array
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, NamedTuple

from embcache.core.allocator import BestFitAllocator, Block
from embcache.core.entries import Entry
from embcache.core.recency import RecencyOrder


class Piece(NamedTuple):
    """A block of a run: free, or an eviction candidate."""

    offset: int
    size: int
    victim: bool


_new_piece = tuple.__new__  # Piece(...) without the namedtuple's Python-level __new__


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
        free_start: Any = None
        free_stop: Any = None
        if left is None or right is None:
            allocator = self._allocator
            if allocator is not None:  # (its boxed ints in and out: ``free_around``)
                free_start, free_stop = allocator.free_around(key, key_end)
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


def _window_in(pieces: list[Piece], need: int, max_batch: int, must: int) -> Window | None:
    """``best_window``, with its answer where no search is needed: none when the pieces span
    less than ``need``; the candidate alone when no other candidate is among them."""
    start, last = pieces[0].offset, pieces[-1]
    span = last.offset + last.size - start
    if span < need:
        return None
    if len(pieces) <= 3 and sum(piece.victim for piece in pieces) == 1:
        return Window((pieces[must].offset,), pieces[must].size, start, span)
    return best_window(pieces, need, max_batch, must)


# The core searches with ``EvictionIndex`` once its order holds this many candidates, and
# scans below (benchmarks/micro/bench_eviction_index.py, compiled, callgrind: the index's
# upkeep costs what it saves at about 157 candidates, a 4 MiB pool of 0.9-57 KB items, and
# saves 13% of a request's instructions at about 600; the index's tables are made at its
# first search, so a pool that never holds this many candidates never pays for them).
INDEX_FROM = 512

_NONE: Final = -1  # no slot, no list, no registered edge
# A slot's bound is kept as a code: a small int (0 to 255, which CPython shares, so the lists
# of codes and of the tree's nodes hold no int of their own on either build; lists, as the
# compiled build reads and writes them fastest) that never falls as the bound rises. Bounds
# below _EXACT units are their own code (a bound is at least the candidate's unit); above,
# eight codes an octave. A code at least the need's is a bound that may reach it: the search
# then compares the bound itself (the registered edges), so the choices are the rule's exactly.
_EXACT: Final = 64
_UNKNOWN: Final = 255  # the code of a bound not measured (or forgotten): above every need's code
_DEAD: Final = 0  # the code of a slot whose candidate left the order, or one a search set aside
_BLOCK: Final = 16  # slots a leaf of the tree covers: the tree keeps each block's largest code


def _code(units: int) -> int:
    """The code of a bound of ``units`` alignment units (``_EXACT`` and up: eight an octave,
    at most 254). Monotone: a larger bound never has a smaller code."""
    if units < _EXACT:
        return units
    bits = units.bit_length()
    code = _EXACT + 8 * (bits - 7) + (units >> (bits - 4)) - 8
    return code if code < _UNKNOWN else _UNKNOWN - 1


class EvictionIndex:
    """The eviction rule of DESIGN.md over a recency order, with what each search learns kept
    for the next: ``search(need)`` chooses exactly what ``VictimSearch`` fed the whole order
    chooses, examining O(log n) candidates in the usual case instead of the order's first k.

    Theory. Rank the candidates by their place in the order (a slot each, in order: a key
    added again gets a new slot). For a candidate c, its *component* is the stretch of free
    blocks and of candidates ranked below c around it, up to the first other allocated block
    on each side (a *barrier*) or the pool's edge; the windows whose newest victim is c lie
    inside it, so a component that spans less than ``need`` has no window for ``need``. The
    rule's k is the rank of the first candidate with a window of its own. Each candidate keeps
    an upper bound on its component's span (unknown until measured), its code (``_code``) in
    a max tree over the candidates in rank order: a search descends to the first candidate
    whose code reaches the need's, compares its bound with ``need``, walks the blocks around
    it (as ``neighbourhood``) when the bound is unknown or reaches ``need``, and either finds
    the rule's window there (``best_window``) or keeps the measured bound and descends again.

    Why the bounds stay bounds. While c stays in the order in the same place, its component
    only grows when one of the barriers it had when measured is freed: a pin or an allocation
    adds barriers; a candidate added later ranks above c and is a barrier to it, as it was
    while pinned. So a measured candidate *registers* its two edges (the barriers' inner
    sides) once, and keeps them until a barrier is freed: ``gone(offset, size, kept)`` (the
    core frees an entry, and its block unless kept) unregisters every candidate whose
    registered component ended where the block began or began where it ended, and forgets
    its bound. A bound is the span between the registered
    edges, never less than the component's. A candidate pinned or freed since its slot was
    made is found stale when a search reaches it (its key is out of the order, or its offset
    points to a newer slot), and dropped.

    Memory: flat tables, nothing per candidate but a slot, and no int object of its own (the
    order's values are two shared bools; codes are small ints; the rest are arrays). Per slot
    (one for each key taken into the order since the last compaction, a quarter more for
    room): its key (a reference), its code (a list item), its registered edges and one list
    link per edge (arrays of the narrowest ints), and an eighth of a list item for the tree
    over its block. Per alignment unit of the pool, made at the first search: the slot of the
    candidate starting there and the heads of the two lists of slots whose registered
    component begins or ends there. Spans and edges are in alignment units.

    Cost. A search takes in the candidates added since the last one (O(log n) each), descends
    the tree (O(log n), then at most ``_BLOCK`` codes) once per candidate it examines, and
    walks each candidate whose bound may reach ``need`` (at most ``max_batch - 1`` candidates
    on each side). ``examined`` counts the candidates a search examined (measured, dropped or
    found short by their bound), ``walked`` the blocks its walks read.
    """

    def __init__(
        self,
        allocator: BestFitAllocator,
        order: RecencyOrder,
        entries: Mapping[str, Entry],
        max_batch: int,
    ) -> None:
        self._allocator = allocator
        self._order = order
        self._entries = entries
        self._max_batch = max_batch
        self._shift = allocator.alignment.bit_length() - 1
        self._units = allocator.capacity >> self._shift
        # The narrowest ints that hold every unit, span and slot (slots: fewer than 5 units
        # a pool; see _compact), and the bound "not measured (or forgotten)": their largest.
        units = self._units
        self._typecode = "h" if units <= 4096 else "i" if units < 1 << 28 else "q"
        self._unknown = (1 << 8 * array(self._typecode).itemsize - 1) - 1
        self._keys: list[str] = []  # slot -> key; slots in rank order
        self._count = 0  # slots in use (the tables below have room for _room)
        self._room = 0  # slots the tables have room for: whole blocks
        self._codes: list[int] = []  # slot -> the code of its bound, or _DEAD
        self._left = self._ints(0)  # slot -> registered start of its component, or _NONE
        self._right = self._ints(0)  # slot -> registered end of its component, or _NONE
        self._next_left = self._ints(0)  # slot -> the next slot registered at the same start
        self._next_right = self._ints(0)  # slot -> the next slot registered at the same end
        self._width = 1  # leaves of the tree: a power of two >= the blocks
        # The tree: the largest code under each node; block b's at _width + b.
        self._tree: list[int] = [_DEAD, _DEAD]
        self._slot_at = self._ints(0)  # unit -> the newest slot of a candidate starting there
        self._starting = self._ints(0)  # unit -> first slot registered to begin there
        self._ending = self._ints(0)  # unit -> first slot registered to end there
        self.searches = 0
        self.examined = 0
        self.walked = 0

    def _ints(self, length: int, value: int = _NONE) -> array[int]:
        return array(self._typecode, [value]) * length

    def gone(self, offset: int, size: int, kept: bool) -> None:
        """The core freed the entry at ``offset`` (``size`` bytes): its slot, if it has one,
        lets go of its key; unless its range is ``kept`` for the entry it was evicted for, the
        block is free, and the components it bounded may grow."""
        slot_at = self._slot_at
        if not slot_at:  # no search yet: nothing taken in
            return
        shift = self._shift
        at = offset >> shift
        slot = slot_at[at]
        if slot != _NONE:
            slot_at[at] = _NONE
            if slot < self._count:
                self._keys[slot] = ""  # (dead now: no entry's offset points to the slot)
        if kept:
            return
        self._unregister(self._ending, at, self._right, self._next_right)
        self._unregister(self._starting, (offset + size) >> shift, self._left, self._next_left)

    def _unregister(
        self, heads: array[int], at: int, edges: array[int], links: array[int]
    ) -> None:
        """Forget the edges registered at unit ``at`` in ``heads`` (a list through ``links``):
        each slot's ``edges`` entry and what its walk measured."""
        slot = heads[at]
        if slot == _NONE:
            return
        heads[at] = _NONE
        while slot != _NONE:
            edges[slot] = _NONE
            self._forget(slot)
            slot = links[slot]

    def search(self, need: int) -> tuple[Window, list[Entry]] | None:
        """The rule's window for ``need`` bytes (a multiple of the alignment) and its victims
        (address order), or None when no run of at most ``max_batch`` candidates and free
        blocks holds ``need``."""
        self.searches += 1
        self._take_in()
        tree, codes, keys, entries, order = (
            self._tree, self._codes, self._keys, self._entries, self._order.marks
        )  # fmt: skip
        shift, slot_at = self._shift, self._slot_at
        units = need >> shift
        wanted = _code(units)
        lowered: list[int] = []  # slots whose code reaches the need's but that had no window
        found: tuple[Window, list[Entry]] | None = None
        while tree[1] >= wanted:
            slot = self._first_at_least(wanted)
            self.examined += 1
            key = keys[slot]
            entry = entries.get(key)
            if entry is None or key not in order or slot_at[entry.offset >> shift] != slot:
                self._set(slot, _DEAD)
                continue
            if codes[slot] != _UNKNOWN and self._right[slot] - self._left[slot] < units:
                lowered.append(slot)  # (measured short of need by less than its code tells)
                self._set(slot, _DEAD)
                continue
            start, stop, whole = self._walk(entry, slot, None)
            bound = self._unknown
            if whole:
                bound = self._register(slot, start, stop)
            if bound >= units:
                window = None
                if stop - start >= need:  # (else no window: the component spans too little)
                    pieces: list[Piece] = []
                    self._walk(entry, slot, pieces)
                    must = next(i for i, piece in enumerate(pieces) if piece[0] == entry.offset)
                    window = _window_in(pieces, need, self._max_batch, must)
                if window is not None:
                    victims = [entries[keys[slot_at[at >> shift]]] for at in window.victims]
                    found = (window, victims)
                    break
                lowered.append(slot)
                self._set(slot, _DEAD)
            elif _code(bound) >= wanted:  # short of need by less than its code tells
                lowered.append(slot)
                self._set(slot, _DEAD)
            else:
                self._set(slot, _code(bound))
        for slot in lowered:
            self._set(slot, self._code_of(slot))
        return found

    # ------------------------------------------------------------------ helpers
    def _code_of(self, slot: int) -> int:
        """The code of the slot's bound: the span of its registered component, else unknown."""
        left, right = self._left[slot], self._right[slot]
        return _UNKNOWN if left == _NONE or right == _NONE else _code(right - left)

    def _forget(self, slot: int) -> None:
        if self._codes[slot] != _DEAD:
            self._set(slot, _UNKNOWN)

    def _register(self, slot: int, start: int, stop: int) -> int:
        """Register the edges of the component ``[start, stop)`` where the slot has none; its
        bound. An edge at the pool's end has no barrier to free and joins no list."""
        shift = self._shift
        if self._left[slot] == _NONE:
            at = start >> shift
            self._left[slot] = at
            if at > 0:
                self._next_left[slot] = self._starting[at]
                self._starting[at] = slot
        if self._right[slot] == _NONE:
            at = stop >> shift
            self._right[slot] = at
            if at < self._units:
                self._next_right[slot] = self._ending[at]
                self._ending[at] = slot
        return self._right[slot] - self._left[slot]

    def _take_in(self) -> None:
        """Give a slot to each candidate added to the order since the last search (the
        order's tail of keys marked new), and mark them taken in."""
        order = self._order.marks
        fresh: list[str] = []
        for key in reversed(order.keys()):
            if not order[key]:
                break
            fresh.append(key)
        if not self._slot_at:  # the first search: the per-unit tables
            units = self._units
            self._slot_at = self._ints(units)
            self._starting, self._ending = self._ints(units + 1), self._ints(units + 1)
        if not fresh:
            return
        for key in fresh:
            order[key] = False
        if self._count + len(fresh) > self._room:
            self._compact(len(fresh))
        keys, slot_at, entries, shift = self._keys, self._slot_at, self._entries, self._shift
        for index in range(len(fresh) - 1, -1, -1):
            key = fresh[index]
            slot = self._count
            self._count = slot + 1
            keys[slot] = key
            slot_at[entries[key].offset >> shift] = slot
            self._set(slot, _UNKNOWN)

    def _live(self, slot: int) -> bool:
        key = self._keys[slot]
        entry = self._entries.get(key)
        return (
            entry is not None
            and key in self._order.marks
            and self._slot_at[entry.offset >> self._shift] == slot
        )

    def _compact(self, more: int) -> None:
        """Renumber the slots of the candidates still in the order, with room for ``more``
        and a quarter again, in whole blocks; the tree and the registration lists are rebuilt,
        keeping every bound. Every per-slot table is made at its final length (no growth by
        appends, no slack but the room)."""
        live = [slot for slot in range(self._count) if self._live(slot)]
        count = len(live)
        kept = [self._codes[slot] for slot in live]
        left = [self._left[slot] for slot in live]
        right = [self._right[slot] for slot in live]
        keys = [self._keys[slot] for slot in live]
        # The per-unit tables are cleared where the old slots wrote, so that no stale slot
        # number is left behind: O(slots), not O(units).
        entries, shift, slot_at = self._entries, self._shift, self._slot_at
        starting, ending = self._starting, self._ending
        for slot in range(self._count):
            entry = entries.get(self._keys[slot])
            if entry is not None:
                slot_at[entry.offset >> shift] = _NONE
            if self._left[slot] != _NONE:
                starting[self._left[slot]] = _NONE
            if self._right[slot] != _NONE:
                ending[self._right[slot]] = _NONE
        room = count + more + (count + more) // 4
        blocks = (room + _BLOCK - 1) // _BLOCK
        room = blocks * _BLOCK
        width = 1
        while width < blocks:
            width *= 2
        self._room, self._width, self._count = room, width, count
        self._keys = keys + [""] * (room - count)
        self._codes = codes = kept + [_DEAD] * (room - count)
        self._tree = tree = [_DEAD] * (2 * width)  # (a list: its reads the fastest)
        for block in range(blocks):
            tree[width + block] = max(codes[block * _BLOCK : (block + 1) * _BLOCK])
        for node in range(width - 1, 0, -1):
            a, b = tree[2 * node], tree[2 * node + 1]
            tree[node] = a if a > b else b
        units, spare = self._units, self._ints(room - count)
        self._left, self._right = (
            array(self._typecode, left) + spare,
            array(self._typecode, right) + spare,
        )
        self._next_left, self._next_right = self._ints(room), self._ints(room)
        for slot, key in enumerate(keys):
            slot_at[entries[key].offset >> shift] = slot
            at = left[slot]
            if at > 0:
                self._next_left[slot] = starting[at]
                starting[at] = slot
            at = right[slot]
            if at != _NONE and at < units:
                self._next_right[slot] = ending[at]
                ending[at] = slot

    def _set(self, slot: int, code: int) -> None:
        """The slot's code is ``code``: its block's largest code and the tree above it follow."""
        codes, tree = self._codes, self._tree
        old = codes[slot]
        codes[slot] = code
        node = self._width + slot // _BLOCK
        top = tree[node]
        if code >= top:
            if code == top:
                return
        elif old < top:  # (the block's largest code is another slot's, and stays)
            return
        else:
            code = _DEAD
            for at in range(slot - slot % _BLOCK, slot - slot % _BLOCK + _BLOCK):
                if codes[at] > code:
                    code = codes[at]
            if code == top:
                return
        tree[node] = code
        node >>= 1
        while node:
            a, b = tree[2 * node], tree[2 * node + 1]
            top = a if a > b else b
            if tree[node] == top:
                return
            tree[node] = top
            node >>= 1

    def _first_at_least(self, code: int) -> int:
        tree, width, node = self._tree, self._width, 1
        while node < width:
            node *= 2
            if tree[node] < code:
                node += 1
        codes, slot = self._codes, (node - width) * _BLOCK
        while codes[slot] < code:
            slot += 1
        return slot

    def _walk(self, entry: Entry, slot: int, pieces: list[Piece] | None) -> tuple[int, int, bool]:
        """The component of the candidate ``entry`` (slot ``slot``), cut at ``max_batch - 1``
        candidates on each side (as ``neighbourhood``): where it starts and stops, and whether
        both edges were reached. ``pieces``, when given, gets its pieces in address order."""
        allocator, room = self._allocator, self._max_batch - 1
        whole = True
        victims, start = 0, entry.offset
        while (block := allocator.block_before(start)) is not None:
            self.walked += 1
            offset = block[0]
            if not block[2]:  # allocated: a candidate ranked below this one, or a barrier
                if not self._ranked_below(offset, slot):
                    break
                if victims == room:
                    whole = False
                    break
                victims += 1
            if pieces is not None:
                pieces.append(_new_piece(Piece, (offset, block[1], not block[2])))
            start = offset
        if pieces is not None:
            pieces.reverse()
            pieces.append(_new_piece(Piece, (entry.offset, entry.size, True)))
        victims, stop = 0, entry.offset + entry.size
        while (block := allocator.block_at(stop)) is not None:
            self.walked += 1
            offset = block[0]
            if not block[2]:
                if not self._ranked_below(offset, slot):
                    break
                if victims == room:
                    whole = False
                    break
                victims += 1
            if pieces is not None:
                pieces.append(_new_piece(Piece, (offset, block[1], not block[2])))
            stop = offset + block[1]
        return start, stop, whole

    def _ranked_below(self, offset: int, slot: int) -> bool:
        """Whether the allocated block at ``offset`` is an evictable entry of a slot below
        ``slot`` (a candidate the walk may take); else it is a barrier. O(1)."""
        other = self._slot_at[offset >> self._shift]
        if other == _NONE or other >= slot:
            return False
        key = self._keys[other]
        neighbour = self._entries.get(key)
        return neighbour is not None and neighbour.offset == offset and key in self._order.marks
