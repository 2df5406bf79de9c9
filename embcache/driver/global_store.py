"""The global-store protocol the cache talks to, and the outcome of one transfer.

A store moves bytes between named objects and ranges of one registered buffer (the pool).
Every batch call returns one result per key; the cache never lets one item's failure hold up
the others. ``classify`` turns a store's negative code into what the cache must do with the
range: FAILED means nothing can still touch it (free it), UNKNOWN means a transfer may still be
touching it (quarantine it until ``fence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from embcache.core.outcomes import TransferOutcome

__all__ = [
    "CLAIM_EXPIRED",
    "CLAIM_TAKEN",
    "ClaimingStore",
    "CopyingStore",
    "GlobalStore",
    "TransferOutcome",
    "get_outcome",
    "put_outcome",
]


@runtime_checkable
class GlobalStore(Protocol):
    """A store shared by encode workers. Offsets are relative to the registered buffer.

    Implementations are called from I/O worker threads, never under a cache lock, and may be
    called concurrently. A method that raises fails all of its items as UNKNOWN.
    """

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register the pool (a contiguous uint8 tensor) once, before any transfer."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored."""

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Read each object into ``pool[offset:offset+size]``; per key bytes read or a code < 0."""

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Write each ``pool[offset:offset+size]`` as an object; per key 0 or a code < 0."""

    def classify(self, code: int) -> TransferOutcome:
        """The outcome a negative ``code`` means for the range it touched."""

    def fence(self) -> None:
        """Return once no transfer started before the call can still touch the pool."""

    def close(self) -> None:
        """Release the store's resources; later calls fail their items."""


@runtime_checkable
class ClaimingStore(GlobalStore, Protocol):
    """A ``GlobalStore`` that can also claim keys fleet-wide (optional; Mooncake's store does).

    A claim is an atomic create with a lease, kept apart from the key's object: it carries no
    embedding bytes and never changes what a read of the key returns.
    """

    @property
    def claim_lease_s(self) -> float:
        """How long a claim nobody releases keeps other claimers out (the store's lease)."""

    def claim(self, keys: Sequence[str]) -> list[int]:
        """Claim each key: 0 where this store now holds the claim, ``CLAIM_TAKEN`` where a
        live claim is another's, another code < 0 where nothing was claimed (no store)."""

    def release(self, keys: Sequence[str]) -> list[int]:
        """End claims this store holds: per key 0, ``CLAIM_EXPIRED`` (its lease ended and
        another claimer took it), or another code < 0 (never held, no store)."""


@runtime_checkable
class CopyingStore(GlobalStore, Protocol):
    """A ``GlobalStore`` that can also move bytes in and out of the store outside the pool
    (optional; Mooncake's store does): how fleet claims publish and load a key that a worker's
    pool did not take (not admitted, no space).
    """

    def put_copies(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[int]:
        """Store a copy of each value's bytes (a contiguous CPU tensor, read in C order) as
        the object of its key; the caller may reuse a value once this returns. A key already
        stored keeps its object (the first put stays) and answers 0. Per key 0 (the key is
        stored) or a code < 0 (nothing of this call's is stored under it)."""

    def get_copies(self, keys: Sequence[str], sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """A copy of each object, as a new CPU uint8 tensor, where it is stored with exactly
        ``size`` bytes; None elsewhere (not stored, another size, no store)."""


#: ``ClaimingStore.claim``'s answer for a key another claimer holds (Mooncake's
#: OBJECT_ALREADY_EXISTS: the claim's put was started by someone else and has not ended).
CLAIM_TAKEN = -705
#: ``ClaimingStore.release``'s answer for a claim whose lease ended and that another claimer
#: took (Mooncake's ILLEGAL_CLIENT: the put was restarted by someone else).
CLAIM_EXPIRED = -601


def get_outcome(store: GlobalStore, code: int, size: int) -> TransferOutcome:
    """Outcome of one ``get_into`` result: OK only for exactly ``size`` bytes, short is FAILED."""
    if code == size:
        return TransferOutcome.OK
    if code >= 0:
        return TransferOutcome.FAILED
    return store.classify(code)


def put_outcome(store: GlobalStore, code: int) -> TransferOutcome:
    """Outcome of one ``put_from`` result."""
    if code == 0:
        return TransferOutcome.OK
    if code > 0:
        return TransferOutcome.FAILED
    return store.classify(code)
