"""``lru``, the default policy: the recency order, every insert admitted (the seed's
behaviour). Pure; the caller holds the cache lock. ``embcache.core.policy`` names every policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from embcache.core.recency import RecencyOrder


class LruPolicy:
    """Least recently used first; admits every insert (the seed's behaviour)."""

    name = "lru"
    records_lookups = False
    records_work = False

    def order(self) -> RecencyOrder:
        """A new recency order."""
        return RecencyOrder()

    def record(self, key: str) -> None:
        """Nothing to note: recency is the order itself."""

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """Always True."""
        return True

    def forget(self, key: str) -> None:
        """Nothing kept per key."""
