"""Recency orders: the evictable keys, oldest first, as an ``OrderedDict`` (``RecencyOrder``),
and one that also notes every key it held (``ResidentOrder``, the admission window's). Each
key's value is its stamp: the number of the ``add`` that put it there (1, 2, ...), so stamps
rise from the oldest key to the newest and a key taken out and put back has a new one (the
eviction index, ``embcache.core.eviction.EvictionIndex``, ranks candidates by it).

A module of its own because these subclass a built-in type: the compiled build
(``docs/setup.md``, "A compiled core") leaves this module to the interpreter, as mypyc cannot
compile a subclass of ``OrderedDict``; their methods run in C either way.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count


class RecencyOrder(OrderedDict[str, int]):
    """Evictable keys by the time they last became evictable, oldest first. Every method O(1).

    An OrderedDict itself (values are the keys' stamps), so membership, iteration and length
    run in C: the core asks them on every hit."""

    def __init__(self) -> None:
        super().__init__()
        self.stamp = count(1).__next__  # the next stamp

    def add(self, key: str) -> None:
        """Put ``key`` at the tail (the newest) with a new stamp. O(1)."""
        self[key] = self.stamp()
        self.move_to_end(key)

    def discard(self, key: str) -> bool:
        """Take ``key`` out; whether it was there. O(1)."""
        return self.pop(key, 0) != 0


class ResidentOrder(RecencyOrder):
    """A recency order that also notes every key it ever held in ``resident``."""

    def __init__(self, resident: set[str]) -> None:
        super().__init__()
        self._resident = resident

    def add(self, key: str) -> None:
        """Put ``key`` at the tail and note it resident. O(1)."""
        self._resident.add(key)
        self[key] = self.stamp()
        self.move_to_end(key)
