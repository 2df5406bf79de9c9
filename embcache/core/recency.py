"""Recency orders: the evictable keys, oldest first, as an ``OrderedDict`` (``RecencyOrder``),
and one that also notes every key it held (``ResidentOrder``, the admission window's).

A module of its own because these subclass a built-in type: the compiled build
(``docs/setup.md``, "A compiled core") leaves this module to the interpreter, as mypyc cannot
compile a subclass of ``OrderedDict``; their methods run in C either way.
"""

from __future__ import annotations

from collections import OrderedDict


class RecencyOrder(OrderedDict[str, bool]):
    """Evictable keys by the time they last became evictable, oldest first. Every method O(1).

    An OrderedDict itself (values are True), so membership, iteration and length run in C:
    the core asks them on every hit."""

    def add(self, key: str) -> None:
        """Put ``key`` at the tail (the newest). O(1)."""
        self[key] = True
        self.move_to_end(key)

    def discard(self, key: str) -> bool:
        """Take ``key`` out; whether it was there. O(1)."""
        return self.pop(key, False)


class ResidentOrder(RecencyOrder):
    """A recency order that also notes every key it ever held in ``resident``."""

    def __init__(self, resident: set[str]) -> None:
        super().__init__()
        self._resident = resident

    def add(self, key: str) -> None:
        """Put ``key`` at the tail and note it resident. O(1)."""
        self._resident.add(key)
        self[key] = True
        self.move_to_end(key)
