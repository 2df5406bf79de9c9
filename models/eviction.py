"""Reference of the eviction rule (DESIGN.md, "Eviction that respects contiguity"), by brute force.

The rule, as DESIGN.md states it: find the smallest ``k`` such that some contiguous run made
only of free blocks and of the ``k`` oldest evictable entries can hold the request with at most
``max_batch`` victims in it; among such runs take the fewest victims, then the fewest bytes,
then the lowest offset, and evict exactly those. No such ``k``: evict nothing.

This model reads that sentence literally and shares nothing with ``embcache.core.eviction`` (no
import, no helper; ``tests/test_eviction.py`` checks both): for each ``k`` it tries every
stretch of consecutive blocks in address order whose blocks are all free or among the ``k``
first candidates, evicts that stretch's candidates on a copy of the layout, and measures the
hole they leave (the free blocks that then touch them). Slow on purpose: O(k * n^3) per call
for n blocks. It takes the whole layout (every block, in address order) and the candidates'
offsets in eviction order, and returns ``Choice`` or None.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple


class Choice(NamedTuple):
    """The victims' offsets in address order, their bytes, and the hole: start and size."""

    victims: tuple[int, ...]
    victim_bytes: int
    offset: int
    span: int


def hole_after_evicting(
    layout: Sequence[tuple[int, int, bool]], victims: set[int]
) -> tuple[int, int]:
    """``(start, size)`` of the free stretch that holds every victim once they are freed.

    ``layout`` is every block as ``(offset, size, free)`` in address order; the victims must
    be blocks of one stretch of free blocks and victims (asserted).
    """
    free_after = [free or offset in victims for offset, _, free in layout]
    index = [i for i, (offset, _, _) in enumerate(layout) if offset in victims]
    first, last = min(index), max(index)
    assert all(free_after[first : last + 1]), "the victims are not one stretch"
    while first > 0 and free_after[first - 1]:
        first -= 1
    while last + 1 < len(layout) and free_after[last + 1]:
        last += 1
    start = layout[first][0]
    return start, layout[last][0] + layout[last][1] - start


def choose_victims(
    need: int,
    order: Sequence[int],
    max_batch: int,
    layout: Sequence[tuple[int, int, bool]],
) -> Choice | None:
    """The rule over ``layout`` (every block as ``(offset, size, free)``, address order) with
    the candidates' offsets ``order`` in eviction order (first victim first)."""
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(layout)), "layout has gaps"
    size_of = {offset: size for offset, size, _ in layout}
    for k in range(1, len(order) + 1):
        oldest = set(order[:k])
        best: tuple[tuple[int, int, int], Choice] | None = None
        for i in range(len(layout)):
            for j in range(i, len(layout)):
                stretch = layout[i : j + 1]
                if not all(free or offset in oldest for offset, _, free in stretch):
                    break  # every longer stretch from i holds this block too
                victims = {offset for offset, _, free in stretch if not free}
                if not victims or len(victims) > max_batch:
                    continue
                start, span = hole_after_evicting(layout, victims)
                if span < need:
                    continue
                victim_bytes = sum(size_of[v] for v in victims)
                choice = Choice(tuple(sorted(victims)), victim_bytes, start, span)
                cost = (len(victims), victim_bytes, start)
                if best is None or cost < best[0]:
                    best = (cost, choice)
        if best is not None:
            return best[1]
    return None
