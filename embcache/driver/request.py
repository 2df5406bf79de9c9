"""``Request``: one serving request's view of the cache, as a context manager.

A request holds pins (HIT items, finished loads, its own inserts), waits (loads in flight) and
reservations (misses it promised to encode). Leaving the ``with`` block, normally or by an
exception, ends every reservation it did not fill (its waiters fall back) and releases every
pin and wait. A request is used by one thread or task at a time; many requests may run
concurrently against one cache.

Theory of operation. ``Request`` holds its own bodies: each method checks the arguments its
contract names and runs the request's core steps through its cache's step runner
(``embcache.driver.runner.StepRunner``), using only the runner's public names (``run``,
``core``, ``store``, ``views``, ``wait``, ``wait_async``). It never reads the core's state:
what it keeps (``_served``: what it may read; ``_reserved``: the ranges its lookups reserved;
``_handed``: the ranges ``begin_fill`` handed out; ``_items``) are copies of its steps'
results, so most requests take few steps (embcache/DESIGN.md, "One owner, few steps"): an
all-hit request is its lookup and its close (``EmbeddingCache.lookup`` opens and looks up in
one step), and one with misses adds one step for the insert that fills what its lookup
reserved.

In-place fills (``begin_fill`` / ``end_fill``): an insert whose bytes someone else writes
(another process mapping the pool, for example vLLM's rank 0). ``begin_fill`` is an insert's
first half (``BeginLoad`` per absent key, or the request's own reservation) and hands out each
range's pool offset instead of copying into it; the entry stays LOADING, so nothing can read,
evict or reuse the range while the writer writes. ``end_fill`` ends it through the same step as
an insert (``end_inserts``): OK (READY, pinned by the request), FAILED (freed) or UNKNOWN
(QUARANTINED until a fence). A request closed with a range still handed out ends it UNKNOWN,
never FAILED: a writer that died mid-write is an unknown outcome like any transfer's.
``offsets`` is ``embeddings`` without the views, for a caller that hands ranges to other
processes (vLLM's scheduler).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from types import TracebackType

import torch

from embcache.core.effects import Fill, Looked, Served
from embcache.core.entries import Entry, RequestState
from embcache.core.lookup_flags import LOOKUP_FLAGS
from embcache.core.outcomes import ItemStatus, Reason, TransferOutcome
from embcache.core.policy import checked_work
from embcache.driver.item import Item, check_key
from embcache.driver.locks import assert_unlocked
from embcache.driver.runner import StepRunner
from embcache.errors import InvalidArgumentError, InvalidTypeError

SERVE = True  # a request's lookups always say what it may read (``LookupFlags.serve``)


class Request:
    """Handle returned by ``EmbeddingCache.request`` and ``EmbeddingCache.lookup``."""

    def __init__(
        self, runner: StepRunner, state: RequestState, items: list[Item] | None = None,
        served: Served | None = None,
    ) -> None:  # fmt: skip
        """A handle on ``state``, run by ``runner``; ``items`` and ``served``: what its first
        lookup found, when that lookup ran before the handle existed (``open``)."""
        self._runner = runner
        self._state = state
        # What it keeps of its steps' results.
        self._items = items  # what it looked up, in order
        self._served = served  # what it may read, from its last step (final); None: ask
        self._reserved: dict[str, Entry] | None = None  # the ranges its lookups reserved
        self._handed: dict[str, Entry] | None = None  # the ranges begin_fill handed out

    @classmethod
    def open(
        cls, runner: StepRunner, request_id: str, items: Sequence[Item], prefetch: bool,
        reserve: bool,
    ) -> tuple[Request, list[ItemStatus]]:  # fmt: skip
        """Open a request on ``runner`` and look ``items`` up (none: only open it), in one
        step when no store is asked (``EmbeddingCache.lookup``); the request and the
        statuses."""
        checked = None if isinstance(items, Item) else list(items)  # (as ``lookup``: inline)
        if checked is None or not all(map(isinstance, checked, repeat(Item))):
            raise InvalidTypeError("lookup takes a sequence of Item")
        ask_store = bool(prefetch) and runner.store is not None and bool(checked)
        flags = LOOKUP_FLAGS[ask_store, bool(reserve), SERVE]
        looked = runner.run(runner.core.begin_lookup, request_id, checked, flags)
        if looked.ask or looked.fills:
            request = cls(runner, looked.request)
            return request, cls._looked(request, checked, looked)
        return cls(runner, looked.request, checked, looked.served), looked.statuses  # (final)

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def items(self) -> list[Item]:
        """The items looked up so far, in lookup order: what ``embeddings()``, ``offsets()``,
        ``fallback_mask()`` and ``fallback_reasons()`` answer about, position by position.
        A copy. O(items)."""
        return list(self._items or ())

    def lookup(
        self, items: Sequence[Item], *, prefetch: bool = True, reserve_misses: bool = False
    ) -> list[ItemStatus]:
        """Look ``items`` up: HIT (pinned), LOADING, RESERVED (you encode and insert) or MISS.

        With ``prefetch``, misses found in the global store start loading into the pool. With
        ``reserve_misses``, other misses are reserved for this request, so concurrent requests
        for the same key wait for its insert instead of encoding it again. A key repeated in
        ``items`` gets the status of its first occurrence and holds one pin. One step (two
        when the global store is asked about misses).
        """
        checked = None if isinstance(items, Item) else list(items)
        if checked is None or not all(map(isinstance, checked, repeat(Item))):  # no frame per item
            raise InvalidTypeError("lookup takes a sequence of Item")
        runner = self._runner
        ask_store = bool(prefetch) and runner.store is not None
        flags = LOOKUP_FLAGS[ask_store, bool(reserve_misses), SERVE]
        looked = runner.run(runner.core.begin_lookup, self._state, checked, flags)
        if looked.ask or looked.fills or self._items is not None:
            return self._looked(checked, looked)
        self._items, self._served = checked, looked.served  # (``_looked``'s common case)
        return looked.statuses

    def _looked(self, items: list[Item], looked: Looked) -> list[ItemStatus]:
        """Keep what a lookup's step said (asking the store first when it names keys); the
        statuses. ``open`` calls it for the step that opened the request."""
        if looked.ask:
            looked = self._ask_store(looked.ask)
        if self._items is None:
            self._items = items  # (a list of its own: ``open`` or ``lookup`` made it)
        else:
            self._items += items
        served = looked.served
        self._served = served if served is not None and served.final else None
        if looked.fills:
            reserved = {items[i].key: entry for i, entry in looked.fills}
            self._reserved = reserved if self._reserved is None else self._reserved | reserved
        return looked.statuses

    def _ask_store(self, ask: list[str]) -> Looked:
        """Which of ``ask`` the store holds (no lock held), then the lookup's second pass."""
        runner = self._runner
        store = runner.store
        assert store is not None  # begin_lookup asks only when there is a store
        assert_unlocked("store exists")
        try:
            found: dict[str, bool] | None = dict(zip(ask, store.exists(ask), strict=True))
        except Exception:
            found = None  # the store failed: the misses fall back with STORE_ERROR
        return runner.run(runner.core.finish_lookup, self._state, found=found, serve=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every load this request waits on has ended; False on timeout."""
        return self._runner.wait(self._state, _check_timeout(timeout))

    async def wait_async(self, timeout: float | None = None) -> bool:
        """``wait`` for asyncio callers; does not block the event loop."""
        return await self._runner.wait_async(self._state, _check_timeout(timeout))

    def embeddings(self) -> list[torch.Tensor | None]:
        """Zero-copy views (shape and dtype of each item) valid until the request ends; None
        for every looked-up item this request does not hold. Every call makes new view
        objects: reshaping one in place (``unsqueeze_``) touches nobody else's, but writing
        into one changes the cached bytes that every request reads."""
        return self._runner.views.views((self._served or self._now()).ranges)

    def fallback_mask(self) -> torch.Tensor:
        """int32 tensor over the looked-up items: 1 where the caller must encode (the torch
        form of ``fallback_list``)."""
        return torch.tensor(self.fallback_list(), dtype=torch.int32)

    def fallback_list(self) -> list[int]:
        """Over the looked-up items: 1 where the caller must encode, else 0."""
        return [1 if r is None else 0 for r in self._now().ranges]

    def fallback_reasons(self) -> list[Reason | None]:
        """Why each looked-up item must be encoded (None for the ones served)."""
        return list(self._now().reasons)

    def offsets(self) -> list[int | None]:
        """``embeddings`` without the views: per looked-up item, the byte offset in
        ``cache.pool`` of the range this request holds, else None."""
        return [None if r is None else r[0] for r in self._now().ranges]

    def lookup_offsets(
        self, items: Sequence[Item], *, prefetch: bool = True
    ) -> list[int | None] | None:
        """``lookup(items, prefetch=prefetch)`` then ``offsets()``, in one step when no store
        is asked; None while the request waits on a load (then ``wait`` and ``offsets``)."""
        self.lookup(items, prefetch=prefetch)
        return self.ready_offsets()

    def ready_offsets(self) -> list[int | None] | None:
        """``offsets()`` when nothing is pending, with no step; None while it waits on a load."""
        served = self._served
        return None if served is None else [None if r is None else r[0] for r in served.ranges]

    def insert(
        self, keys: Sequence[str], tensors: Sequence[torch.Tensor], *, publish: bool = True,
        work: Sequence[float] | None = None,
    ) -> list[bool]:  # fmt: skip
        """Copy fresh encoder outputs into the pool, keeping their dtype; True where cached.

        Keys this request reserved are filled (the tensor must match the reserved shape and
        dtype); absent keys are added; a key present otherwise is left alone (False). Inserted
        entries are pinned by this request, and published to the global store when asked.
        ``work``: each output's measured encoder seconds (finite, >= 0), for a policy that
        admits by work (``adaptive-work``); None: unknown. One step when every key is one
        this request's lookups reserved, else two.
        """
        if isinstance(keys, str) or len(keys) != len(tensors):
            raise InvalidArgumentError("insert takes a list of keys and a list of as many tensors")
        runner = self._runner
        core = runner.core
        fills = None if self._reserved is None else self._reserved_fills(keys, tensors)
        items = None  # (every key one it reserved and no work: no Item to build)
        if fills is None or work is not None:
            items = [Item.of(k, t) for k, t in zip(keys, tensors, strict=True)]  # (checks)
        seconds = None if items is None or work is None else checked_work(work, items)
        check = fills is not None  # nothing checked the request before the copy: the end does
        if fills is None:
            assert items is not None  # (built above when nothing was reserved)
            _, fills = runner.run(core.begin_insert, items, request=self._state, hand_out=False)
        outcomes, error = runner.views.copy_in([(e, tensors[i]) for i, e in fills])
        results = runner.run(
            core.end_inserts, self._state, fills, outcomes, count=len(keys),
            publish=publish and error is None and runner.store is not None, check=check,
            work=seconds,
        )  # fmt: skip
        reserved = self._reserved
        if reserved is not None:  # those it filled are no longer reserved
            if len(fills) == len(reserved):
                self._reserved = None
            else:
                for _, entry in fills:
                    reserved.pop(entry.key, None)
        self._served = None  # (what it reads changed: a later read asks the core)
        if error is not None:
            raise error
        return results

    def _reserved_fills(
        self, keys: Sequence[str], tensors: Sequence[torch.Tensor]
    ) -> list[Fill] | None:
        """The fills of ``keys`` when each is a key this request's lookups reserved (a
        duplicate once) and each tensor a tensor, else None. Raises ``InvalidArgumentError``
        when a tensor's shape or dtype differs from its reservation's."""
        reserved = self._reserved
        if not reserved:
            return None  # (it reserved nothing: ``begin_insert`` plans the fills)
        fills: list[Fill] = []
        planned: set[str] = set()
        for i, (key, tensor) in enumerate(zip(keys, tensors, strict=True)):
            entry = reserved.get(key) if type(key) is str else None
            if entry is None or not isinstance(tensor, torch.Tensor):
                return None  # (``Item.of`` checks it, and ``begin_insert`` plans)
            if key in planned:
                continue
            shape = tuple(tensor.shape)
            if entry.shape != shape or entry.dtype != tensor.dtype:  # (``matches``)
                raise InvalidArgumentError(
                    f"tensor for {key!r} has shape {shape} and dtype "
                    f"{tensor.dtype}, but it was reserved as {entry.shape} {entry.dtype}"
                )
            fills.append((i, entry))
            planned.add(key)
        return fills

    def begin_fill(self, items: Sequence[Item]) -> list[int | None]:
        """Reserve a pool range for each absent item (or take this request's reservation) and
        return its byte offset in ``cache.pool``, for a writer outside this process to fill in
        place; None where nothing is to be written (present, or no space). The entry stays
        LOADING until ``end_fill``; closing the request first ends it UNKNOWN (quarantined
        until a fence, since the writer may still write). O(items)."""
        if isinstance(items, Item) or not all(isinstance(it, Item) for it in items):
            raise InvalidTypeError("begin_fill takes a sequence of Item")
        runner = self._runner
        _, fills = runner.run(runner.core.begin_insert, items, request=self._state, hand_out=True)
        offsets: list[int | None] = [None] * len(items)
        handed = self._handed
        if handed is None:
            handed = self._handed = {}
        for i, entry in fills:
            offsets[i] = entry.offset
            handed[entry.key] = entry
        return offsets

    def end_fill(
        self,
        keys: Sequence[str],
        outcomes: Sequence[TransferOutcome],
        *,
        publish: bool = True,
    ) -> list[bool]:
        """End the fills of ``keys`` with their writers' outcomes: OK makes the entry READY
        (pinned by this request), FAILED frees it, UNKNOWN quarantines it; True where cached
        (False for a key not handed out). Cached entries are published when asked and a
        store exists. O(keys)."""
        if isinstance(keys, str) or len(keys) != len(outcomes):
            raise InvalidArgumentError("end_fill takes a list of keys and as many outcomes")
        if not all(isinstance(o, TransferOutcome) for o in outcomes):
            raise InvalidTypeError(f"end_fill outcomes must be TransferOutcome, got {outcomes!r}")
        keys = [check_key(k) for k in keys]
        handed = self._handed or {}
        fills: list[Fill] = []
        ends: list[TransferOutcome] = []
        for i, (key, outcome) in enumerate(zip(keys, outcomes, strict=True)):
            entry = handed.get(key)
            if entry is not None:
                fills.append((i, entry))
                ends.append(outcome)
        runner = self._runner
        results = runner.run(
            runner.core.end_inserts, self._state, fills, ends, count=len(keys),
            publish=publish and runner.store is not None, handed_out=True,
        )  # fmt: skip
        reserved = self._reserved or {}
        for _, entry in fills:
            handed.pop(entry.key, None)
            reserved.pop(entry.key, None)
        self._served = None  # (what it reads changed: a later read asks the core)
        return results

    def publish(self, keys: Sequence[str]) -> list[bool]:
        """(Re)publish entries this request holds to the global store, for example ones the
        store lost; True where a write started (False: not held READY by this request, or a
        publish of it is already running). The write runs on the I/O pool under its own pin;
        ``stats().publishes_ok`` / ``publishes_failed`` count how it ended."""
        if isinstance(keys, str):
            raise InvalidTypeError("publish takes a list of keys, got a str")
        keys = [check_key(k) for k in keys]
        runner = self._runner
        store = runner.store is not None
        return runner.run(runner.core.publish, keys, request=self._state, store=store)

    def close(self) -> None:
        """End reservations, release every pin and wait. Idempotent."""
        runner = self._runner
        self._served = self._reserved = None  # (an embeddings or insert after it must fail)
        runner.run(runner.core.end_request, self._state)

    def __enter__(self) -> Request:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _now(self) -> Served:
        """What it may read: from its last step while nothing was pending, else one step."""
        served = self._served
        if served is None:
            runner = self._runner
            step = runner.core.finish_lookup
            served = runner.run(step, self._state, found=None, serve=True).served
            assert served is not None  # (asked for)
            if served.final:
                self._served = served
        return served


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidTypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise InvalidArgumentError(f"timeout must be >= 0 seconds, got {timeout}")
    return None if math.isinf(timeout) else float(timeout)
