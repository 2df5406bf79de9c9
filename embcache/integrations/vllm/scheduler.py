"""The scheduler role: owns the cache over the shared pool and decides, step by step, what
every rank loads and saves (embcache/DESIGN.md, "vLLM: the scheduler/worker split").

Theory of operation. One embcache ``Request`` per vLLM request holds that request's pins.
``ensure`` looks its items up (store reads start, the request is deferred while one runs);
``has_item`` is True only for an item the current request holds; ``alloc`` turns a held item
into a load every rank must ack, or, in a producer role, reserves a staging range that rank 0
fills; ``build`` hands the step's transfers out; ``absorb`` counts acks, inserts acked saves
from staging and closes a finished request once nothing of it is outstanding. A request that
finished with acks missing past ``hold_timeout_s`` is quarantined: its pins and staging ranges
are held for good (a rank may still read them), and only a late ack ends that hold.

vLLM calls all of this from its one scheduler thread; nothing here takes a lock of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from embcache import (
    EmbeddingCache,
    GlobalStore,
    InvalidArgumentError,
    InvariantError,
    Item,
    RangeAllocator,
    Request,
)
from embcache.integrations.vllm.options import ConnectorOptions
from embcache.integrations.vllm.protocol import (
    EmbcacheECMetadata,
    EmbcacheECWorkerMetadata,
    StepKey,
    Transfer,
)
from embcache.integrations.vllm.shm import SharedPool

__all__ = ["Feature", "SchedulerSide", "SchedulerStats"]
log = logging.getLogger(__name__)

Feature = tuple[str, int, int]  # (identifier, rows, width) of one multimodal item


@dataclass(eq=False, slots=True)
class _Held:
    """What the scheduler keeps for one vLLM request."""

    request: Request
    items: list[Item]  # by vLLM item index
    present: dict[str, int] | None = None  # key -> pool offset of what it holds; None: pending
    loads: set[StepKey] = field(default_factory=set)  # awaiting acks of every rank
    saves: set[StepKey] = field(default_factory=set)  # awaiting rank 0's ack
    finished_at: float | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters of the scheduler role (a snapshot)."""

    steps: int
    deferred: int
    loads: int
    saves: int
    saves_skipped: int  # no staging space: the item is encoded, not cached
    inserts: int
    open_requests: int
    outstanding_loads: int
    outstanding_saves: int
    quarantined_requests: int
    quarantined_bytes: int


class SchedulerSide:
    """The scheduler role over ``options``; ``ranks`` workers ack every load."""

    def __init__(
        self,
        options: ConnectorOptions,
        ranks: int,
        *,
        consumer: bool,
        producer: bool,
        store: GlobalStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
            raise InvalidArgumentError(f"the engine's world size must be > 0, got {ranks!r}")
        self._ranks = ranks
        self._consumer, self._producer = consumer, producer
        self._clock = clock
        self._hold_timeout = options.hold_timeout_s
        self._capacity = options.pool_bytes
        self._shared = SharedPool(options.pool_bytes + options.staging_bytes)
        self._own_store = store is None
        self._store = _store(options) if store is None else store
        try:
            pool = self._shared.tensor[: options.pool_bytes]
            self._cache = EmbeddingCache(
                options.pool_bytes, store=self._store, policy=options.policy, pool=pool
            )
        except BaseException:
            self._close_store()
            raise
        self._base = self._shared.tensor.data_ptr()
        self._staging = RangeAllocator(options.staging_bytes)
        self._held: dict[str, _Held] = {}
        self._current: _Held | None = None
        self._step = 0
        self._step_loads: dict[str, Transfer] = {}
        self._step_saves: dict[str, Transfer] = {}
        self._load_acks: dict[StepKey, tuple[str, set[int]]] = {}  # -> (request, ranks missing)
        self._save_acks: dict[StepKey, tuple[str, Item, int]] = {}  # -> (request, item, offset)
        self._quarantined: set[str] = set()
        self._counts = dict.fromkeys(("deferred", "loads", "saves", "saves_skipped", "inserts"), 0)

    @property
    def cache(self) -> EmbeddingCache:
        """The cache this role owns."""
        return self._cache

    # -- vLLM's calls, in its order ------------------------------------------------------
    def ensure(self, request_id: str, features: Sequence[Feature], dtype: torch.dtype) -> bool:
        """``ensure_cache_available``: open and look up on first sight; False (defer) while a
        store read for one of its items runs. O(items)."""
        held = self._held.get(request_id)
        if held is None:
            items = [Item(key, (rows, width), dtype) for key, rows, width in features]
            held = _Held(self._cache.request(request_id), items)
            self._held[request_id] = held
            unique = list({it.key: it for it in items}.values())
            held.request.lookup(unique, prefetch=self._consumer)
        self._current = None
        if held.present is None:
            if not held.request.wait(0):
                self._counts["deferred"] += 1
                return False
            views = held.request.embeddings()
            unique = list({it.key: it for it in held.items}.values())
            held.present = {
                it.key: v.data_ptr() - self._base
                for it, v in zip(unique, views, strict=True)
                if v is not None
            }
        self._current = held
        return True

    def has_item(self, key: str) -> bool:
        """``has_cache_item``: True only for an item the current request holds READY. O(1)."""
        held = self._current
        return self._consumer and held is not None and key in (held.present or ())

    def alloc(self, request_id: str, index: int) -> None:
        """``update_state_after_alloc``: a held item becomes a load; otherwise a producer
        reserves a staging range for the fresh output. O(log staging ranges)."""
        held = self._held.get(request_id)
        if held is None or held.present is None or not 0 <= index < len(held.items):
            return
        item = held.items[index]
        if self._consumer and item.key in held.present:
            if item.key not in self._step_loads:
                step_key = (self._step, item.key)
                self._step_loads[item.key] = Transfer(
                    item.key, held.present[item.key], item.shape, item.dtype
                )
                self._load_acks[step_key] = (request_id, set(range(self._ranks)))
                held.loads.add(step_key)
                self._counts["loads"] += 1
        elif self._producer and item.key not in held.present and item.key not in self._step_saves:
            offset = self._staging.allocate(item.nbytes)
            if offset is None:
                self._counts["saves_skipped"] += 1
                return
            step_key = (self._step, item.key)
            self._step_saves[item.key] = Transfer(
                item.key, self._capacity + offset, item.shape, item.dtype
            )
            self._save_acks[step_key] = (request_id, item, offset)
            held.saves.add(step_key)
            self._counts["saves"] += 1

    def build(self) -> EmbcacheECMetadata:
        """``build_connector_meta``: the step's transfers; the next step begins. O(transfers)."""
        meta = EmbcacheECMetadata(
            self._step,
            self._shared.handle,
            list(self._step_loads.values()),
            list(self._step_saves.values()),
        )
        self._step += 1
        self._step_loads, self._step_saves = {}, {}
        self._current = None
        self._expire()
        return meta

    def absorb(self, acks: EmbcacheECWorkerMetadata) -> None:
        """``update_connector_output``: count acks, insert acked saves, close what is done.
        Unknown or repeated acks are ignored. O(acks)."""
        touched: set[str] = set()
        for rank, done in acks.loaded.items():
            for step_key in done:
                entry = self._load_acks.get(step_key)
                if entry is None:
                    continue
                request_id, missing = entry
                missing.discard(rank)
                if not missing:
                    del self._load_acks[step_key]
                    self._held[request_id].loads.discard(step_key)
                    touched.add(request_id)
        for step_key, ok in acks.saved.items():
            saved = self._save_acks.pop(step_key, None)
            if saved is not None:
                touched.add(self._end_save(step_key, *saved, ok))
        for request_id in touched:
            self._close_if_done(request_id)
        self._expire()

    def finish(self, request_id: str) -> None:
        """``request_finished``: close now, or once every ack came. O(1)."""
        held = self._held.get(request_id)
        if held is None:
            return
        held.finished_at = self._clock()
        if self._current is held:
            self._current = None
        self._close_if_done(request_id)

    # -- the rest ------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """A snapshot of the counters. O(requests)."""
        quarantined = [self._held[r] for r in self._quarantined]
        pinned = {
            it.key: it.nbytes for h in quarantined for it in h.items if it.key in (h.present or ())
        }
        staged = sum(self._save_acks[k][1].nbytes for h in quarantined for k in h.saves)
        return SchedulerStats(
            steps=self._step,
            open_requests=len(self._held),
            outstanding_loads=len(self._load_acks),
            outstanding_saves=len(self._save_acks),
            quarantined_requests=len(quarantined),
            quarantined_bytes=sum(pinned.values()) + staged,
            **self._counts,
        )

    def check_invariants(self) -> None:
        """The cache's invariants, then the connector's: every outstanding load or save belongs
        to an open request that lists it; a request is open only while vLLM runs it or an ack
        is outstanding; staging holds exactly the outstanding saves. O(n log n)."""
        self._cache.check_invariants()
        self._staging.check_invariants()
        for step_key, (request_id, missing) in self._load_acks.items():
            held = self._held.get(request_id)
            if held is None or step_key not in held.loads or not missing:
                raise InvariantError(f"load {step_key} of {request_id!r}: not held by its request")
        for step_key, (request_id, _, _) in self._save_acks.items():
            held = self._held.get(request_id)
            if held is None or step_key not in held.saves:
                raise InvariantError(f"save {step_key} of {request_id!r}: not held by its request")
        for request_id, held in self._held.items():
            if held.finished_at is not None and not (held.loads or held.saves):
                raise InvariantError(f"request {request_id!r} finished, acked, still open")
        staged = sorted(offset for _, _, offset in self._save_acks.values())
        if staged != sorted(offset for offset, _ in self._staging.allocations()):
            raise InvariantError(f"staging holds {self._staging.allocations()}, saves {staged}")
        if not self._quarantined <= self._held.keys():
            raise InvariantError(f"quarantined {self._quarantined - self._held.keys()} not held")

    def close(self) -> None:
        """Release everything (the ranks are gone), close the cache and the shared pool."""
        for held in self._held.values():
            held.request.close()
        self._held.clear()
        self._quarantined.clear()
        self._cache.close()
        self._close_store()

    def _close_store(self) -> None:
        try:
            if self._own_store and self._store is not None:
                self._store.close()
        finally:
            self._shared.close()

    def _end_save(
        self, step_key: StepKey, request_id: str, item: Item, offset: int, ok: bool
    ) -> str:
        held = self._held[request_id]
        held.saves.discard(step_key)
        if ok:
            start = self._capacity + offset
            staged = self._shared.tensor[start : start + item.nbytes].view(item.dtype)
            if held.request.insert([item.key], [staged.view(item.shape)])[0]:
                self._counts["inserts"] += 1
        self._staging.free(offset)
        return request_id

    def _close_if_done(self, request_id: str) -> None:
        held = self._held[request_id]
        if held.finished_at is not None and not (held.loads or held.saves):
            held.request.close()
            del self._held[request_id]
            self._quarantined.discard(request_id)

    def _expire(self) -> None:
        """Quarantine finished requests whose acks are overdue."""
        now = self._clock()
        for request_id, held in self._held.items():
            if (
                request_id not in self._quarantined
                and held.finished_at is not None
                and now - held.finished_at >= self._hold_timeout
            ):
                self._quarantined.add(request_id)
                missing = {r for k in held.loads for r in self._load_acks[k][1]}
                log.warning(
                    "request %s: no ack from ranks %s after %g s; its %d bytes stay held",
                    request_id,
                    sorted(missing),
                    self._hold_timeout,
                    self._held_bytes(held),
                )

    def _held_bytes(self, held: _Held) -> int:
        present = held.present or {}
        pinned = sum(
            it.nbytes for it in {i.key: i for i in held.items}.values() if it.key in present
        )
        return pinned + sum(self._save_acks[k][1].nbytes for k in held.saves)


def _store(options: ConnectorOptions) -> GlobalStore | None:
    """The Mooncake store ``options`` names; None (no global tier) when it names no master."""
    if options.mooncake_master is None:
        return None
    from embcache.store.mooncake import MooncakeStore

    return MooncakeStore(
        options.mooncake_master,
        global_segment_size=options.mooncake_segment,
        key_prefix=options.key_prefix,
    )
