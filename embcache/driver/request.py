"""``Request``: one serving request's view of the cache, as a context manager.

A request holds pins (HIT items, finished loads, its own inserts), waits (loads in flight) and
reservations (misses it promised to encode). Leaving the ``with`` block, normally or by an
exception, ends every reservation it did not fill (its waiters fall back) and releases every
pin and wait. A request is used by one thread or task at a time; many requests may run
concurrently against one cache.

``Request`` holds no state of its own: its state is the core's ``RequestState``, changed only
under the cache lock by the driver that owns it. So each method checks the arguments its
contract names and hands the request's state to the driver through ``RequestDriver``, the
internal interface below (``EmbeddingCache`` implements it in ``embcache.driver.cache`` and
``embcache.driver.fills``). Its methods are underscored because they belong to the package,
not to users: they take a ``RequestState``, which only a ``Request`` has.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from types import TracebackType
from typing import Protocol

import torch

from embcache.core.entries import RequestState
from embcache.core.outcomes import ItemStatus, Reason, TransferOutcome
from embcache.driver.item import Item
from embcache.errors import InvalidArgumentError, InvalidTypeError


class RequestDriver(Protocol):
    """The internal interface ``Request`` uses (module docstring): one method per step a
    request can take, each given the request's state and carrying out that step under the
    driver's lock; ``EmbeddingCache`` implements it. Nothing but ``Request`` calls these."""

    def _lookup_items(
        self, rs: RequestState, items: Sequence[Item], prefetch: bool, reserve: bool
    ) -> list[ItemStatus]: ...
    def _wait(self, rs: RequestState, timeout: float | None) -> bool: ...
    async def _wait_async(self, rs: RequestState, timeout: float | None) -> bool: ...
    def _embeddings(self, rs: RequestState) -> list[torch.Tensor | None]: ...
    def _fallback(self, rs: RequestState) -> tuple[list[int], list[Reason | None]]: ...
    def _insert(
        self, rs: RequestState, keys: Sequence[str], tensors: Sequence[torch.Tensor], publish: bool
    ) -> list[bool]: ...
    def _publish(self, rs: RequestState, keys: Sequence[str]) -> list[bool]: ...
    def _begin_fill(self, rs: RequestState, items: Sequence[Item]) -> list[int | None]: ...
    def _end_fill(
        self,
        rs: RequestState,
        keys: Sequence[str],
        outcomes: Sequence[TransferOutcome],
        publish: bool,
    ) -> list[bool]: ...
    def _offsets(self, rs: RequestState) -> list[int | None]: ...
    def _lookup_offsets(
        self, rs: RequestState, items: Sequence[Item], prefetch: bool
    ) -> list[int | None] | None: ...
    def _close_request(self, rs: RequestState) -> None: ...


class Request:
    """Handle returned by ``EmbeddingCache.request``."""

    def __init__(self, cache: RequestDriver, state: RequestState) -> None:
        self._cache = cache
        self._state = state

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def items(self) -> list[Item]:
        """The items looked up so far, in lookup order: what ``embeddings()``, ``offsets()``,
        ``fallback_mask()`` and ``fallback_reasons()`` answer about, position by position.
        A copy. O(items)."""
        return list(self._state.items)  # type: ignore[arg-type]  # the core keeps them duck-typed

    def lookup(
        self, items: Sequence[Item], *, prefetch: bool = True, reserve_misses: bool = False
    ) -> list[ItemStatus]:
        """Look ``items`` up: HIT (pinned), LOADING, RESERVED (you encode and insert) or MISS.

        With ``prefetch``, misses found in the global store start loading into the pool. With
        ``reserve_misses``, other misses are reserved for this request, so concurrent requests
        for the same key wait for its insert instead of encoding it again. A key repeated in
        ``items`` gets the status of its first occurrence and holds one pin.
        """
        checked = None if isinstance(items, Item) else list(items)
        if checked is None or not all(map(isinstance, checked, repeat(Item))):  # no frame per item
            raise InvalidTypeError("lookup takes a sequence of Item")
        return self._cache._lookup_items(self._state, checked, prefetch, reserve_misses)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every load this request waits on has ended; False on timeout."""
        return self._cache._wait(self._state, _check_timeout(timeout))

    async def wait_async(self, timeout: float | None = None) -> bool:
        """``wait`` for asyncio callers; does not block the event loop."""
        return await self._cache._wait_async(self._state, _check_timeout(timeout))

    def embeddings(self) -> list[torch.Tensor | None]:
        """Zero-copy views (shape and dtype of each item) valid until the request ends; None
        for every looked-up item this request does not hold. Every call makes new view
        objects: reshaping one in place (``unsqueeze_``) touches nobody else's, but writing
        into one changes the cached bytes that every request reads."""
        return self._cache._embeddings(self._state)

    def fallback_mask(self) -> torch.Tensor:
        """int32 tensor over the looked-up items: 1 where the caller must encode."""
        mask, _ = self._cache._fallback(self._state)
        return torch.tensor(mask, dtype=torch.int32)

    def fallback_reasons(self) -> list[Reason | None]:
        """Why each looked-up item must be encoded (None for the ones served)."""
        _, reasons = self._cache._fallback(self._state)
        return reasons

    def insert(
        self, keys: Sequence[str], tensors: Sequence[torch.Tensor], *, publish: bool = True
    ) -> list[bool]:
        """Copy fresh encoder outputs into the pool, keeping their dtype; True where cached.

        Keys this request reserved are filled (the tensor must match the reserved shape and
        dtype); absent keys are added; a key present otherwise is left alone (False). Inserted
        entries are pinned by this request, and published to the global store when asked.
        """
        return self._cache._insert(self._state, keys, tensors, publish)

    def begin_fill(self, items: Sequence[Item]) -> list[int | None]:
        """Reserve a pool range for each absent item (or take this request's reservation) and
        return its byte offset in ``cache.pool``, for a writer outside this process to fill in
        place; None where nothing is to be written (present, or no space). The entry stays
        LOADING until ``end_fill``; closing the request first ends it UNKNOWN (quarantined
        until a fence, since the writer may still write). See ``embcache.driver.fills``."""
        return self._cache._begin_fill(self._state, items)

    def end_fill(
        self,
        keys: Sequence[str],
        outcomes: Sequence[TransferOutcome],
        *,
        publish: bool = True,
    ) -> list[bool]:
        """End the fills of ``keys`` with their writers' outcomes: OK makes the entry READY
        (pinned by this request), FAILED frees it, UNKNOWN quarantines it; True where cached.
        Cached entries are published when asked and a store exists."""
        return self._cache._end_fill(self._state, keys, outcomes, publish)

    def offsets(self) -> list[int | None]:
        """``embeddings`` without the views: per looked-up item, the byte offset in
        ``cache.pool`` of the range this request holds, else None."""
        return self._cache._offsets(self._state)

    def lookup_offsets(
        self, items: Sequence[Item], *, prefetch: bool = True
    ) -> list[int | None] | None:
        """``lookup(items, prefetch=prefetch)`` then ``offsets()``, in one locked step when
        no store is asked; None while the request waits on a load (then ``wait`` and
        ``offsets``)."""
        return self._cache._lookup_offsets(self._state, items, prefetch)

    def publish(self, keys: Sequence[str]) -> list[bool]:
        """(Re)publish entries this request holds to the global store, for example ones the
        store lost; True where a write started (False: not held READY by this request, or a
        publish of it is already running). The write runs on the I/O pool under its own pin;
        ``stats().publishes_ok`` / ``publishes_failed`` count how it ended."""
        return self._cache._publish(self._state, keys)

    def close(self) -> None:
        """End reservations, release every pin and wait. Idempotent."""
        self._cache._close_request(self._state)

    def __enter__(self) -> Request:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidTypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise InvalidArgumentError(f"timeout must be >= 0 seconds, got {timeout}")
    return None if math.isinf(timeout) else float(timeout)
