"""Debug mode: overwrite every range the moment the core frees it, so a stale read shows.

A caller that keeps a view of cached bytes after its request released them reads whatever the
pool holds by then: usually the same bytes, so the bug hides. With poisoning on
(``EmbeddingCache(poison_freed=True)`` or ``EMBCACHE_POISON=1``), ``PoisoningLock`` wraps the
cache lock and, before each release, fills every range the core freed while it was held with
``POISON`` (0xFF bytes: NaN in every float dtype). It writes under the lock on purpose, so no
allocation can take the range before it is poisoned; it is slow and meant for tests only.
"""

from __future__ import annotations

import os
from types import TracebackType

import torch

from embcache.core.cache_core import CacheCore
from embcache.locks import HierarchyLock

POISON = 0xFF


def poison_requested() -> bool:
    """Whether ``EMBCACHE_POISON`` asks for the debug mode."""
    return os.environ.get("EMBCACHE_POISON", "") not in ("", "0")


class PoisoningLock:
    """The cache lock, poisoning the core's freed ranges before every release."""

    def __init__(self, lock: HierarchyLock, core: CacheCore, pool: torch.Tensor) -> None:
        self._lock = lock
        self._core = core
        self._pool = pool
        self.name = lock.name
        self.level = lock.level
        core.freed = []

    def acquire(self) -> None:
        self._lock.acquire()

    def release(self) -> None:
        self._poison()
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> PoisoningLock:
        self._lock.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def _poison(self) -> None:
        freed = self._core.freed
        if freed:
            for offset, size in freed:
                self._pool[offset : offset + size].fill_(POISON)
            freed.clear()
