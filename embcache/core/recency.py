"""Recency orders: the evictable keys, oldest first, as an ``OrderedDict`` (``RecencyOrder``),
and one that also notes every key it held (``ResidentOrder``, the admission window's). Each
key's value says whether it is new to the eviction index (``embcache.core.eviction.
EvictionIndex``, which ranks candidates by their place in the order): ``add`` puts a key at the
tail with True, and the index sets False on the keys it takes in, so the keys it has not seen
are the tail's run of True values. Two shared objects: no int per key.

A module of its own because these subclass a built-in type: the compiled build
(``docs/setup.md``, "A compiled core") leaves this module to the interpreter, as mypyc cannot
compile a subclass of ``OrderedDict``; their methods run in C either way.
"""

from __future__ import annotations

from collections import OrderedDict


class RecencyOrder(OrderedDict[str, bool]):
    """Evictable keys by the time they last became evictable, oldest first. Every method O(1).

    An OrderedDict itself (values: new to the eviction index, module docstring), so
    membership, iteration and length run in C: the core asks them on every hit."""

    def add(self, key: str) -> None:
        """Put ``key`` at the tail (the newest), new to the eviction index. O(1)."""
        self[key] = True
        self.move_to_end(key)

    def discard(self, key: str) -> bool:
        """Take ``key`` out; whether it was there. O(1)."""
        return self.pop(key, None) is not None


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
