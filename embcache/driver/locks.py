"""The lock hierarchy of DESIGN.md, with an optional checker.

Level 1 is the cache lock, level 2 a ``RangeAllocator``'s lock, level 3 the trace
outbox's lock (held only to queue or pick a batch of trace events). A thread may only take a
lock of a strictly higher level than every lock it already holds, and must hold no lock at all
while it does blocking work (a store call, a payload copy, an encoder call, a callback, a wait).

Checking is off by default: ``new_lock`` then makes a plain ``threading.Lock`` (taking it runs
no Python code), and ``HierarchyLock`` costs one global read over one. The test suite turns it
on (``EMBCACHE_LOCK_CHECK=1`` or ``enable_lock_checking()``) and every violation raises
``LockOrderError``; a lock ``new_lock`` made while checking was off stays unchecked.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

from embcache.errors import LockOrderError

CACHE_LEVEL = 1
ALLOCATOR_LEVEL = 2
TRACE_LEVEL = 3



class LockChecking:
    """Whether the checker is on (``on``), process-wide: one object, so that a hot path can
    skip a guard that would do nothing with one attribute read (``if CHECKING.on:
    assert_unlocked(...)``) and still follow ``enable_lock_checking``."""

    __slots__ = ("on",)

    def __init__(self, on: bool) -> None:
        self.on = on


CHECKING = LockChecking(os.environ.get("EMBCACHE_LOCK_CHECK", "") not in ("", "0"))
_held = threading.local()


def enable_lock_checking(enabled: bool = True) -> None:
    """Turn the hierarchy checker on or off for every lock, process-wide."""
    CHECKING.on = enabled


def lock_checking_enabled() -> bool:
    """Whether the checker is on."""
    return CHECKING.on


def _held_stack() -> list[HierarchyLock]:
    stack: list[HierarchyLock] | None = getattr(_held, "stack", None)
    if stack is None:
        stack = []
        _held.stack = stack
    return stack


def assert_unlocked(what: str) -> None:
    """Raise ``LockOrderError`` if this thread holds any hierarchy lock while doing ``what``."""
    if CHECKING.on and _held_stack():
        names = ", ".join(lock.name for lock in _held_stack())
        raise LockOrderError(f"{what} while holding {names}: release every lock first")


def new_lock(level: int, name: str) -> HierarchyLock | threading.Lock:
    """A non-reentrant lock at ``level``: a ``HierarchyLock`` while checking is on, else a
    plain ``threading.Lock`` (the same calls: ``with``, ``acquire``, ``release``, ``locked``)."""
    return HierarchyLock(level, name) if CHECKING.on else threading.Lock()


class HierarchyLock:
    """A non-reentrant lock with a level in the hierarchy."""

    __slots__ = ("_lock", "level", "name")

    def __init__(self, level: int, name: str) -> None:
        self._lock = threading.Lock()
        self.level = level
        self.name = name

    def acquire(self) -> None:
        """Take the lock; with checking on, refuse an acquisition against the hierarchy."""
        if CHECKING.on:
            stack = _held_stack()
            if stack and stack[-1].level >= self.level:
                raise LockOrderError(
                    f"taking {self.name} (level {self.level}) while holding "
                    f"{stack[-1].name} (level {stack[-1].level}): locks must be taken in "
                    "increasing level order"
                )
            self._lock.acquire()
            stack.append(self)
        else:
            self._lock.acquire()

    def release(self) -> None:
        """Release the lock."""
        if CHECKING.on:
            stack = _held_stack()
            if self in stack:
                stack.remove(self)
        self._lock.release()

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return self._lock.locked()

    def __enter__(self) -> HierarchyLock:
        if CHECKING.on:
            self.acquire()
        else:  # the hot path: one call less
            self._lock.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if CHECKING.on:
            self.release()
        else:
            self._lock.release()
