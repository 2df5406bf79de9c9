"""In-place fills: an insert whose bytes someone else writes (another process mapping the
pool, for example vLLM's rank 0), through ``Request.begin_fill`` and ``Request.end_fill``.

Theory of operation. ``begin_fill`` is an insert's first half (``BeginLoad`` per absent key, or
the request's own reservation) and hands out each range's pool offset instead of copying into
it; the entry stays LOADING, so nothing can read, evict or reuse the range while the writer
writes. ``end_fill`` is the second half: ``EndLoad`` with the writer's outcome, OK (READY,
pinned by the request), FAILED (nothing was written: freed) or UNKNOWN (the writer may still be
writing: QUARANTINED until a fence). A request closed with a range still handed out ends it
UNKNOWN, never FAILED: a writer that died mid-write is an unknown outcome like any transfer's.
The caller copies nothing: the driver only changes state (two core steps through the driver's
funnel, ``EmbeddingCache._run``; ``end_fill``'s step also starts the publishes).

``offsets`` is ``embeddings`` without the views: the pool offset of each item the request
holds, for a caller that hands ranges to other processes rather than reading them;
``open_lookup`` and ``Request.lookup_offsets`` fuse a lookup with it, one core step when no
store is asked (a single-threaded caller on its critical path: vLLM's scheduler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from embcache.core.outcomes import TransferOutcome
from embcache.driver.item import Item, check_key
from embcache.driver.request import Request
from embcache.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from embcache.core.cache_core import CacheCore
    from embcache.core.effects import Effects
    from embcache.core.entries import RequestState
    from embcache.driver.global_store import GlobalStore

__all__ = ["InPlaceFills"]
T = TypeVar("T")


class InPlaceFills:
    """The in-place fill methods of ``EmbeddingCache``: ``open_lookup``, and its part of the
    interface ``Request`` uses (``embcache.driver.request.RequestDriver``)."""

    if TYPE_CHECKING:  # what they use of the driver (``embcache.driver.cache``)
        _core: CacheCore
        _store: GlobalStore | None

        def request(self, request_id: str) -> Request: ...
        def _lookup_items(
            self, rs: RequestState, items: Sequence[Item], prefetch: bool, reserve: bool
        ) -> list[Any]: ...

        def _run(self, step: Callable[..., Effects[T]], *args: Any) -> T: ...

    def _begin_fill(self, rs: RequestState, items: Sequence[Item]) -> list[int | None]:
        """``Request.begin_fill``: BeginLoad each absent key (or take its reservation) and
        return its range's pool offset; None where nothing is to be written. O(items)."""
        if isinstance(items, Item) or not all(isinstance(it, Item) for it in items):
            raise InvalidTypeError("begin_fill takes a sequence of Item")
        fills = self._run(self._core.begin_fills, rs, items)
        offsets: list[int | None] = [None] * len(items)
        for i, entry in fills:
            offsets[i] = entry.offset
        return offsets

    def _end_fill(
        self,
        rs: RequestState,
        keys: Sequence[str],
        outcomes: Sequence[TransferOutcome],
        publish: bool,
    ) -> list[bool]:
        """``Request.end_fill``: EndLoad each handed-out range with its writer's outcome, then
        publish the cached ones when asked and a store exists; True where cached. O(keys)."""
        if isinstance(keys, str) or len(keys) != len(outcomes):
            raise InvalidArgumentError("end_fill takes a list of keys and as many outcomes")
        if not all(isinstance(o, TransferOutcome) for o in outcomes):
            raise InvalidTypeError(f"end_fill outcomes must be TransferOutcome, got {outcomes!r}")
        keys = [check_key(k) for k in keys]
        publish = publish and self._store is not None
        return self._run(self._core.end_fills, rs, keys, outcomes, publish)

    def _offsets(self, rs: RequestState) -> list[int | None]:
        """``Request.offsets``: per looked-up item, the pool offset of the range it holds
        (READY, pinned for it), else None. O(items)."""
        ranges = self._run(self._core.served, rs)
        return [None if r is None else r[0] for r in ranges]

    def open_lookup(
        self, request_id: str, items: Sequence[Item], *, prefetch: bool = True
    ) -> tuple[Request, list[int | None] | None]:
        """``request(request_id)``, ``lookup(items, prefetch=prefetch)`` and ``offsets()`` in
        one locked step when no store is to be asked; the offsets are None while the request
        waits on a load (``wait``, then ``offsets``). O(items)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidTypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if self._store is not None and prefetch:
            request = self.request(request_id)
            return request, self._lookup_offsets(request._state, items, prefetch)
        rs, offsets = self._run(self._core.open_lookup, request_id, _items(items))
        return Request(self, rs), offsets  # type: ignore[arg-type]

    def _lookup_offsets(
        self, rs: RequestState, items: Sequence[Item], prefetch: bool
    ) -> list[int | None] | None:
        """``Request.lookup_offsets``."""
        checked = _items(items)
        if self._store is not None and prefetch:  # misses ask the store: two passes
            self._lookup_items(rs, checked, prefetch, False)
            return self._run(self._core.offsets_when_ready, rs)
        return self._run(self._core.lookup_offsets, rs, checked)


def _items(items: Sequence[Item]) -> list[Item]:
    checked = None if isinstance(items, Item) else list(items)
    if checked is None or not all(isinstance(it, Item) for it in checked):
        raise InvalidTypeError("lookup takes a sequence of Item")
    return checked
