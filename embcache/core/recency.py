"""Recency orders: the evictable keys, oldest first, as an ``OrderedDict`` (``RecencyOrder``),
and one that also notes every key it held (``ResidentOrder``, the admission window's). Once
the eviction index (``embcache.core.eviction.EvictionIndex``, which ranks candidates by it)
calls ``start_stamps``, each key's value is its stamp: the number of the ``add`` that put it
there, so stamps rise from the oldest key to the newest and a key taken out and put back has a
new one. Until then every value is 1, one shared int.

A module of its own because these subclass a built-in type: the compiled build
(``docs/setup.md``, "A compiled core") leaves this module to the interpreter, as mypyc cannot
compile a subclass of ``OrderedDict``; their methods run in C either way.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count, repeat


class RecencyOrder(OrderedDict[str, int]):
    """Evictable keys by the time they last became evictable, oldest first. Every method O(1).

    An OrderedDict itself (values are the keys' stamps), so membership, iteration and length
    run in C: the core asks them on every hit."""

    def __init__(self) -> None:
        super().__init__()
        self.stamp = repeat(1).__next__  # every key 1 (one shared int) until ``start_stamps``

    def start_stamps(self) -> int:
        """Stamp the keys held (1, 2, ... oldest first) and every ``add`` from now on with
        the next number; the highest stamp given. O(n), once: an order that nothing ranks
        by stamp (no eviction index made) keeps one shared int for all its keys."""
        stamps = count(1)
        for key in self:  # (values change, not keys: the iteration stays valid)
            self[key] = next(stamps)
        self.stamp = stamps.__next__
        return len(self)

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
