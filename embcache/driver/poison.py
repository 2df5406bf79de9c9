"""Debug mode: overwrite every range the moment the core frees it, so a stale read shows.

A caller that keeps a view of cached bytes after its request released them reads whatever the
pool holds by then: usually the same bytes, so the bug hides. With poisoning on
(``EmbeddingCache(poison_freed=True)`` or ``EMBCACHE_POISON=1``), the core records every range
it frees and the driver fills each with ``POISON`` (0xFF bytes: NaN in every float dtype) at the
end of the locked step that freed it. It writes under the lock on purpose, so no allocation can
take the range before it is poisoned; it is slow and meant for tests only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

POISON = 0xFF


def poison_requested() -> bool:
    """Whether ``EMBCACHE_POISON`` asks for the debug mode."""
    return os.environ.get("EMBCACHE_POISON", "") not in ("", "0")


def poison(pool: torch.Tensor, freed: Iterable[tuple[int, int]]) -> None:
    """Fill each freed ``(offset, size)`` range of ``pool`` with ``POISON``."""
    for offset, size in freed:
        pool[offset : offset + size].fill_(POISON)
