"""What a lookup tells the caller about each item, why an item falls back, and how a
transfer ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.Enum):
    """Per-item answer of ``Request.lookup``."""

    HIT = "HIT"  # pinned for this request: read it with embeddings()
    LOADING = "LOADING"  # a load was started or joined: wait(), then read or fall back
    RESERVED = "RESERVED"  # this request must encode it and insert() it; others wait on it
    MISS = "MISS"  # encode it; see the reason


class Reason(enum.Enum):
    """Why an item is a miss or fell back."""

    NOT_FOUND = "not_found"  # neither in the pool nor in the global store
    TOO_LARGE = "too_large"  # larger than the whole pool
    NO_SPACE = "no_space"  # no range could be freed without touching pinned or busy entries
    NOT_ADMITTED = "not_admitted"  # the policy kept the entries it would have evicted
    MISMATCH = "mismatch"  # cached under this key with another shape or dtype
    BUSY = "busy"  # the entry is being removed or is quarantined
    STORE_ERROR = "store_error"  # the store's exists() failed
    LOAD_FAILED = "load_failed"  # the store read failed (missing, short, wrong size)
    LOAD_UNKNOWN = "load_unknown"  # the store read ended with an unknown outcome
    ABANDONED = "abandoned"  # the request that reserved it ended without inserting it
    REMOVED = "removed"  # the entry was removed while its load was in flight
    TIMEOUT = "timeout"  # still loading when the caller stopped waiting


class TransferOutcome(enum.Enum):
    """How a transfer into or out of a pool range ended."""

    OK = "OK"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class ItemStatus:
    """Status of one looked-up item; ``reason`` is set for MISS."""

    status: Status
    reason: Reason | None = None

    def __repr__(self) -> str:
        return (
            self.status.name if self.reason is None else f"{self.status.name}({self.reason.value})"
        )


# Statuses are immutable: the common ones are shared.
HIT = ItemStatus(Status.HIT)
LOADING_STATUS = ItemStatus(Status.LOADING)
RESERVED_STATUS = ItemStatus(Status.RESERVED)
MISSES = {reason: ItemStatus(Status.MISS, reason) for reason in Reason}
