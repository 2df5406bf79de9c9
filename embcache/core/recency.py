"""Recency orders: the evictable keys, oldest first, as an ``OrderedDict`` (``RecencyOrder``),
and one that also keeps the keys it held that left it (``ResidentOrder``, the admission
window's). Each key's value says whether it is new to the eviction index
(``embcache.core.eviction.EvictionIndex``, which ranks candidates by their place in the order):
``add`` puts a key at the tail with True, and the index sets False on the keys it takes in, so
the keys it has not seen are the tail's run of True values. Two shared objects: no int per key.

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
    """A recency order that also keeps, in ``aside``, the keys that left it by ``discard``
    (pinned, or about to be forgotten): its keys and ``aside`` are every key it held that its
    owner has not taken out of ``aside`` since (the policy's resident keys). ``aside`` holds
    only keys out of the order, so an idle cache's resident keys cost no table of their own."""

    def __init__(self, aside: set[str]) -> None:
        super().__init__()
        self._set_aside, self._take_back = aside.add, aside.discard  # bound once: every hit

    def add(self, key: str) -> None:
        """Put ``key`` at the tail (out of ``aside``). O(1)."""
        self._take_back(key)
        self[key] = True
        self.move_to_end(key)

    def discard(self, key: str) -> bool:
        """Take ``key`` out, into ``aside``; whether it was there. O(1)."""
        if self.pop(key, None) is not None:  # (False: a key the eviction index took in)
            self._set_aside(key)
            return True
        return False
