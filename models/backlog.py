"""Reference model of the publish backlog (``embcache.driver.backlog.PublishBacklog``).

Failed publishes wait for the store, each with its age (when it first failed; a retry that
fails again keeps it), at most ``max_entries``: one more drops the oldest, waiting or being
retried, and counts it. A retry dropped while in flight is forgotten when it ends. One retry
at a time: nothing is taken while one is in flight, dropped or not. An OK publish takes its
key out; an UNKNOWN one never waits. A retry whose entry is gone (evicted, removed,
quarantined, busy) is stale. Dicts and ``min`` over ages: O(n) everywhere, obvious.
"""

from __future__ import annotations

OK, FAILED = "OK", "FAILED"


class ModelBacklog:
    def __init__(self, max_entries: int) -> None:
        self.max = max_entries
        self.waiting: dict[str, int] = {}  # key -> age (smaller: older)
        self.flight: dict[str, int] = {}  # taken by a retry, not ended
        self.gone: set[str] = set()  # in flight, dropped by the bound
        self.ages = 0
        self.dropped = 0
        self.stale = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.flight)

    def note(self, keys: list[str], outcomes: list[str]) -> None:
        """Publishes of ``keys`` ended with ``outcomes``."""
        for key, outcome in zip(keys, outcomes, strict=True):
            if key in self.gone:
                self.gone.discard(key)
                continue
            age = self.flight.pop(key, None)
            if outcome == OK:
                self.waiting.pop(key, None)
            elif outcome == FAILED:
                if age is None:
                    self.ages += 1
                    age = self.ages
                self.waiting[key] = age
        while len(self) > self.max:
            both = {**self.waiting, **self.flight}
            oldest = min(both, key=both.__getitem__)
            if oldest in self.flight:
                del self.flight[oldest]
                self.gone.add(oldest)
            else:
                del self.waiting[oldest]
            self.dropped += 1

    def take(self, limit: int | None) -> list[str]:
        """The ``limit`` oldest waiting keys (None: all), oldest first; none while a retry is
        in flight (one the bound dropped included)."""
        if self.flight or self.gone:
            return []
        keys = sorted(self.waiting, key=self.waiting.__getitem__)[:limit]
        for key in keys:
            self.flight[key] = self.waiting.pop(key)
        return keys

    def skipped(self, key: str) -> None:
        """A taken key whose retry did not start."""
        if self.flight.pop(key, None) is not None:
            self.stale += 1
        self.gone.discard(key)
