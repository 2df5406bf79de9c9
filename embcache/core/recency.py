"""Recency orders: the evictable keys, oldest first (``RecencyOrder``), and one that also keeps
the keys it held that left it (``ResidentOrder``, the admission window's).

Each holds its keys in ``marks``, an ``OrderedDict`` whose value says whether the key is new to
the eviction index (``embcache.core.eviction.EvictionIndex``, which ranks candidates by their
place in the order): ``add`` puts a key at the tail marked True, and the index marks False the
keys it takes in, so the keys it has not seen are the tail's run of True values. Two shared
objects: no int per key.

Composition, not a subclass of ``OrderedDict``: the compiled build compiles these classes
(mypyc cannot compile a subclass of a built-in type), so the core's calls of ``add`` and
``discard``, two on every hit, are C calls, not interpreter frames.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled: the tests' planted orders extend it
class RecencyOrder:
    """Evictable keys by the time they last became evictable, oldest first. Every method O(1)
    (iteration O(n)); membership, iteration and length are ``marks``'s, in C."""

    def __init__(self) -> None:
        self.marks: OrderedDict[str, bool] = OrderedDict()  # key -> new to the index

    def add(self, key: str) -> None:
        """Put ``key`` at the tail (the newest), new to the eviction index. O(1)."""
        marks = self.marks
        marks[key] = True
        marks.move_to_end(key)

    def discard(self, key: str) -> bool:
        """Take ``key`` out; whether it was there. O(1)."""
        return self.marks.pop(key, None) is not None

    def __contains__(self, key: object) -> bool:
        return key in self.marks

    def __iter__(self) -> Iterator[str]:
        return iter(self.marks)

    def __len__(self) -> int:
        return len(self.marks)


class ResidentOrder(RecencyOrder):
    """A recency order that also keeps, in ``aside``, the keys that left it by ``discard``
    (pinned, or about to be forgotten): its keys and ``aside`` are every key it held that its
    owner has not taken out of ``aside`` since (the policy's resident keys). ``aside`` holds
    only keys out of the order, so an idle cache's resident keys cost no table of their own."""

    def __init__(self, aside: set[str]) -> None:
        super().__init__()
        self._aside = aside

    def add(self, key: str) -> None:
        """Put ``key`` at the tail (out of ``aside``). O(1)."""
        self._aside.discard(key)
        super().add(key)

    def discard(self, key: str) -> bool:
        """Take ``key`` out, into ``aside``; whether it was there. O(1)."""
        if super().discard(key):
            self._aside.add(key)
            return True
        return False
