"""embcache as SGLang's ``EmbeddingCacheController`` (the 0.5.23 interface, and the older one).

Theory of operation. SGLang's multimodal encoder server (``MMEncoder``) builds one controller
per TP rank and, on rank 0 only, runs each request through it: ``batch_is_exist``,
``prefetch``, ``check_prefetch_progress`` polled, ``has_local_embedding`` per hit (the items it
answers False for are encoded: the fallback mask), ``store_to_pool_async`` of fresh encoder
outputs, ``get_embedding_dim``, then ``get_pool_views``/``release_pool_views`` (CPU output) or
``load_to_device_async``/``wait_load_to_device`` (GPU output), and on a background thread
``wait_store_to_pool`` and ``insert_batch``. ``EmbeddingCacheController`` answers every call
with the same signature on one ``EmbeddingCache`` (public API only):

- ``prefetch`` opens a ``Request`` and looks the hashes up: hits are pinned, hashes in the
  global store start loading, loads in flight are joined. Its pins stay until the matching
  release (``sglang_holds``): a hit cannot be evicted between ``has_local_embedding`` and the
  read, which SGLang's own controller does not guarantee.
- ``has_local_embedding`` is True exactly for hashes a finished prefetch (or a reader) pins,
  so every hash it answers True for can be read: a failed, short, unknown or too-large load
  and a full pool answer False, and that item falls back.
- ``store_to_pool_async`` reserves the fresh keys (a concurrent request for the same key waits
  for this insert instead of encoding it again) and stages the tensors: CPU tensors are taken
  as they are (SGLang refuses them; do not modify them before ``wait_store_to_pool``), CUDA
  tensors are copied to pinned host memory on a side stream. ``wait_store_to_pool`` copies the
  staged tensors into the pool, makes them READY and starts their publish to the global store;
  its pins end there. SGLang publishes in ``insert_batch``, which MMEncoder calls right after;
  here ``insert_batch`` finds that publish already started and has nothing left to send. Keys
  that were READY already when staged are published again at once (``Request.publish``), as
  SGLang's ``insert_batch`` pushes every READY entry it is given (the store keeps one copy).
- The CUDA paths (side-stream copies, events) are tested by ``tests/test_cuda.py``, which runs
  them only where torch sees a GPU (``bash .ci/cuda``; CI has none): docs/sglang.md.

Holds that SGLang abandons (an exception between ``prefetch`` and the read, a prefetch wait
that timed out, a ``store_to_pool_async`` never waited) end ``hold_timeout_s`` after they began,
on a later ``prefetch`` or ``store_to_pool_async`` call.

The store: an embcache ``GlobalStore`` given as ``embedding_store`` is used as is. Anything else
(SGLang's own ``MooncakeEmbeddingStore``, built by MMEncoder from its flags) is kept alive, so
the global segment it mounted keeps serving, and a ``MooncakeStore`` transfer client is built
from the same ``MOONCAKE_*`` environment, with SGLang's key prefix ``emb_``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embcache import EmbeddingCache, EntryState, GlobalStore, Item, ItemStatus, Status
from embcache.driver.request import Request
from embcache.errors import InvalidArgumentError
from embcache.integrations.sglang_holds import Holds, Prefetch, Staged, forget_mine
from embcache.integrations.sglang_modality import ModalityDims

__all__ = [
    "EmbeddingCacheController",
    "LoadHandle",
    "StoreHandle",
]

logger = logging.getLogger(__name__)

_STATUS = operator.attrgetter("status")  # an ItemStatus's Status
SGLANG_KEY_PREFIX = "emb_"  # MooncakeEmbeddingStore.get_key: objects shared with SGLang's own


@dataclass(frozen=True, eq=False)
class StoreHandle:
    """One staged item of a ``store_to_pool_async`` call; pass to ``wait_store_to_pool``."""

    staged: Staged
    key: str


@dataclass(frozen=True, eq=False)
class LoadHandle:
    """One ``load_to_device_async`` copy; pass to ``wait_load_to_device``."""

    key: str
    event: Any  # torch.cuda.Event, None for a copy into a CPU tensor (done already)

    def is_complete(self) -> bool:
        """Whether the copy has ended (SGLang's ``AsyncCopyHandle.is_complete``)."""
        return self.event is None or bool(self.event.query())


def as_2d(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.ndim == 2 else tensor.reshape(-1, tensor.shape[-1])


def _check_lengths(name: str, mm_hashes: Sequence[object], values: Sequence[object]) -> None:
    if len(mm_hashes) != len(values):
        raise InvalidArgumentError(
            f"{len(mm_hashes)} mm_hashes but {len(values)} {name}: give one per hash"
        )


def _tp_layout() -> tuple[int, int, Any]:
    """(tp_size, tp_rank, tp cpu group): SGLang's ``get_parallel()`` where SGLang runs, else the
    default ``torch.distributed`` group when one is initialized, else one rank."""
    try:
        from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found]
    except ImportError:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank(), dist.group.WORLD
        return 1, 0, None
    parallel = get_parallel()
    return int(parallel.tp_size), int(parallel.tp_rank), parallel.tp_group.cpu_group


def _gloo_group(tp_group: Any) -> Any:
    """A gloo group over ``tp_group``'s ranks (a collective: every rank of the world calls it)."""
    ranks = torch.distributed.get_process_group_ranks(tp_group)
    try:
        from sglang.srt.distributed.parallel_state import (  # type: ignore[import-not-found]
            create_custom_parallel_group,
        )
    except ImportError:
        return torch.distributed.new_group(ranks, backend="gloo")
    return create_custom_parallel_group(group_ranks=ranks, backend="gloo")


class ControllerBase:
    """What both interfaces share: the cache, the holds, prefetch, reads and stats."""

    hold_timeout_s = 300.0  # SGLang waits 60 s for a prefetch; MMEncoder reads right after
    all_rank_get = False
    cache_policy = "adaptive-work"  # EmbeddingCache(policy=...), its default; SGLang passes none

    def _setup(
        self,
        embedding_store: object,
        pool_bytes: int,
        hidden_dims: dict[Any, int] | None,
        dtype: torch.dtype,
        tp: tuple[int, int, Any],
        cache_options: dict[str, Any],
    ) -> None:
        self.tp_world_size, self.tp_rank, self.tp_group = tp
        self._dims = ModalityDims(hidden_dims or {})
        self.hidden_dims = self._dims.hidden_dims
        self.dtype = dtype
        self.embedding_store = embedding_store
        self.prefetch_tp_group = _gloo_group(self.tp_group) if self.tp_world_size > 1 else None
        self._holds = Holds()
        self._ids = itertools.count()
        self._streams: dict[str, Any] = {}
        self._make_cache: Callable[[], EmbeddingCache] = lambda: EmbeddingCache(
            pool_bytes, store=self._store(), policy=self.cache_policy, **cache_options
        )
        self._owned_store: GlobalStore | None = None
        self._cache_or_none = self._make_cache() if self.tp_rank == 0 else None

    def _store(self) -> GlobalStore:
        """``embedding_store`` if it is an embcache store, else a Mooncake transfer client."""
        if isinstance(self.embedding_store, GlobalStore):
            return self.embedding_store
        from embcache.store.mooncake import MooncakeStore

        self._owned_store = MooncakeStore(global_segment_size=0, key_prefix=SGLANG_KEY_PREFIX)
        return self._owned_store

    @property
    def cache(self) -> EmbeddingCache:
        """The embcache instance (made on first use on ranks other than 0: MMEncoder calls the
        controller on rank 0 only, so other ranks never allocate a pool)."""
        if self._cache_or_none is None:
            self._cache_or_none = self._make_cache()
        return self._cache_or_none

    def close(self) -> None:
        """Close every open hold and the cache (the store too, if the cache made it)."""
        self._close(self._holds.expire(float("inf")))
        if self._cache_or_none is not None:
            self._cache_or_none.close()
        if self._owned_store is not None:
            self._owned_store.close()

    # ------------------------------------------------------------------ SGLang calls
    def prefetch(
        self,
        req_id: str,
        mm_hashes: list[str],
        expected_tokens: list[int],
        modality: Any = None,
    ) -> None:
        """Pin the hits and start loading the global hits of ``mm_hashes`` for ``req_id``."""
        dim = self._dims.dim_or_warn(modality, "prefetch")
        if dim is None:
            forget_mine()
            return
        holds = self._holds
        try:
            if len(mm_hashes) != len(expected_tokens):
                _check_lengths("expected_tokens", mm_hashes, expected_tokens)  # raises
            now = time.monotonic()
            if now >= holds.earliest:  # (``_expire``, its early return inlined)
                self._close(holds.expire(now))
            tokens = list(map(int, expected_tokens))
            items = Item.of_matrices(mm_hashes, tokens, dim, self.dtype)
            request, statuses = self._lookup(req_id, items)  # one step: open and look up
        except BaseException:
            forget_mine()  # (a prefetch refused before it started)
            raise
        kinds = list(map(_STATUS, statuses))
        served = None  # loads to wait for: finished by check_prefetch_progress
        if kinds.count(Status.HIT) == len(kinds):
            served = [True] * len(kinds)
        elif Status.LOADING not in kinds:
            served = [k is Status.HIT for k in kinds]
        prefetch = Prefetch(request, req_id, items)
        self._close(holds.start(prefetch, now + self.hold_timeout_s, served))

    def check_prefetch_progress(self, req_id: str) -> bool:
        """Whether ``req_id``'s loads have ended (True for an unknown ``req_id``); never waits."""
        prefetch = self._holds.running(req_id)
        ready = True
        if prefetch is not None:
            ready = prefetch.request.wait(0)
            if ready:
                served = [reason is None for reason in prefetch.request.fallback_reasons()]
                self._close(self._holds.finish(prefetch, served))
        if self.all_rank_get and self.tp_world_size > 1:
            flag = torch.tensor([int(ready)], dtype=torch.int)
            torch.distributed.all_reduce(
                flag, op=torch.distributed.ReduceOp.MIN, group=self.prefetch_tp_group
            )
            ready = bool(flag.item())
        return ready

    async def batch_is_exist(self, mm_hashes: list[str]) -> list[bool]:
        """Per hash: READY in the pool, or stored in the global store. A store that cannot
        answer (a dead master) makes its hashes misses; the local hits stay hits (SGLang's
        controller raises, and MMEncoder then encodes every item). The event loop runs only
        the local check (one hold of the cache's lock); the hashes not READY are asked of the
        store on a worker thread (``asyncio.to_thread``), so the loop serves other tasks while
        the store answers."""
        cache = self.cache
        ready = EntryState.READY
        found = [state is ready for state in cache.entry_states(mm_hashes)]
        store = cache.store
        if store is None or all(found):
            return found
        missing = [i for i, hit in enumerate(found) if not hit]
        keys = [mm_hashes[i] for i in missing]
        try:
            stored = await asyncio.to_thread(store.exists, keys)
        except Exception:
            logger.warning("batch_is_exist: the global store failed; %d misses", len(keys))
            return found
        for i, exists in zip(missing, stored, strict=True):
            found[i] = bool(exists)
        return found

    def get_stats(self) -> dict[str, Any]:
        """SGLang's keys where embcache has the same number, the whole snapshot, and the size
        of each container of the pin accounting (``holds``: empty once every prefetch is read
        and every staged store waited for)."""
        stats = self.cache.stats()
        mib = 1 << 20
        return {
            "total_evicted": stats.evicted_bytes,
            "eviction_count": stats.evictions,
            "allocation_failures": sum(stats.allocation_failures_by_reason.values()),
            "num_cached": stats.entries,
            "num_pinned": stats.pinned_entries,
            "allocated_mb": stats.allocated_bytes / mib,
            "free_mb": stats.free_bytes / mib,
            "total_mb": stats.capacity_bytes / mib,
            "embcache": dataclasses.asdict(stats),
            "holds": self._holds.sizes(),
        }

    # ------------------------------------------------------------------ helpers
    def _request(self, label: str) -> Request:
        return self.cache.request(f"sglang:{label}#{next(self._ids)}")

    def _lookup(
        self, label: str, items: list[Item], prefetch: bool = True, reserve: bool = False
    ) -> tuple[Request, list[ItemStatus]]:
        """A request opened and ``items`` looked up in one step: the request and statuses."""
        request_id = f"sglang:{label}#{next(self._ids)}"
        return self.cache.lookup(request_id, items, prefetch=prefetch, reserve_misses=reserve)

    def _fresh_views(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Each key's view over the pool, pinned until its release; None where not held."""
        views: dict[Prefetch, list[torch.Tensor | None]] = {}
        result: list[torch.Tensor | None] = []
        for taken in self._holds.take(keys):
            if taken is None:
                result.append(None)
                continue
            prefetch, index = taken
            if prefetch not in views:
                views[prefetch] = prefetch.request.embeddings()
            result.append(views[prefetch][index])
        return result

    def _give_back(self, keys: Sequence[str]) -> None:
        self._close(self._holds.give_back(keys))

    def _expire(self) -> None:
        self._close(self._holds.expire(time.monotonic()))

    @staticmethod
    def _close(requests: Sequence[Request]) -> None:
        for request in requests:
            request.close()

    def _stream(self, device: torch.device) -> Any:
        """This controller's side stream on ``device`` (CUDA only)."""
        stream = self._streams.get(str(device))
        if stream is None:
            stream = self._streams[str(device)] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return stream


class EmbeddingCacheController(ControllerBase):
    """SGLang 0.5.23's ``EmbeddingCacheController``, same constructor and methods, on embcache.

    ``max_pool_size_gb`` sizes one pool shared by every modality (SGLang splits it 80/20
    between vision and audio). ``enable_eviction`` and ``max_eviction_batch`` go to the cache.
    """

    def __init__(
        self,
        embedding_store: Any,
        max_pool_size_gb: float = 4.0,
        hidden_dims: dict[Any, int] | None = None,
        all_rank_get: bool = False,
        enable_eviction: bool = True,
        max_eviction_batch: int = 100,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.all_rank_get = all_rank_get
        pool_bytes = int(max_pool_size_gb * (1 << 30)) // 256 * 256
        if pool_bytes <= 0:
            raise InvalidArgumentError(
                f"max_pool_size_gb={max_pool_size_gb} gives no pool: give at least 256 bytes' worth"
            )
        options = {"enable_eviction": enable_eviction, "max_eviction_batch": max_eviction_batch}
        self._setup(embedding_store, pool_bytes, hidden_dims, dtype, _tp_layout(), options)

    def has_local_embedding(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is pinned for a reader: False means the item must be encoded."""
        return self._holds.has(mm_hash)

    def get_pool_views(self, mm_hashes: list[str]) -> list[list[torch.Tensor] | None]:
        """Per hash, a one-element list with a zero-copy (tokens, dim) view, None if not held.
        Each view stays valid until ``release_pool_views`` of its hash."""
        return [None if v is None else [v] for v in self._fresh_views(mm_hashes)]

    def release_pool_views(self, mm_hashes: list[str]) -> None:
        """End one read of each hash (``get_pool_views``); the last one frees the pins."""
        self._give_back(mm_hashes)

    def load_to_device_async(
        self, mm_hash: str, dst_tensor: torch.Tensor, dst_token_offset: int
    ) -> LoadHandle | None:
        """Copy ``mm_hash`` into ``dst_tensor`` rows from ``dst_token_offset`` (on a side stream
        for a CUDA ``dst_tensor``, at once for a CPU one); None if it is not held."""
        taken = self._holds.take([mm_hash])[0]
        if taken is None:
            logger.warning("load_to_device_async: %s is not held; it must be encoded", mm_hash)
            return None
        prefetch, index = taken
        try:
            if prefetch.views is None:
                prefetch.views = prefetch.request.embeddings()
            source = prefetch.views[index]
            assert source is not None, "a held item has a view"
            target = dst_tensor[dst_token_offset : dst_token_offset + source.shape[0]]
            return LoadHandle(mm_hash, self._copy(source, target))
        except BaseException:
            self._give_back([mm_hash])
            raise

    def wait_load_to_device(self, handles: list[LoadHandle]) -> None:
        """Wait for the copies, then end their reads (the pins go with the last one)."""
        errors = []
        for handle in handles:
            try:
                if handle.event is not None:
                    handle.event.synchronize()
            except Exception as exc:
                errors.append(exc)
        self._give_back([h.key for h in handles])
        if errors:
            raise errors[0]

    def store_to_pool_async(
        self, mm_hashes: list[str], tensors: list[torch.Tensor], modality: Any = None
    ) -> list[StoreHandle]:
        """Reserve the absent keys and stage their tensors (CPU or CUDA); items that cannot be
        cached (present, being filled, wrong width, no space) are skipped, as in SGLang."""
        dim = self._dims.dim_or_warn(modality, "store_to_pool_async")
        if dim is None:
            return []
        _check_lengths("tensors", mm_hashes, tensors)
        self._expire()
        rows: dict[str, torch.Tensor] = {}
        for key, tensor in zip(mm_hashes, tensors, strict=True):
            row = as_2d(tensor) if tensor.ndim else tensor  # 0-d: no width, skipped
            if row.ndim == 0 or row.shape[-1] != dim or row.numel() == 0:
                logger.warning(
                    "store_to_pool_async: %s has shape %s, pool dim %d; skipped",
                    key,
                    tuple(row.shape),
                    dim,
                )
                continue
            rows.setdefault(key, row)
        if not rows:
            return []
        items = [Item(k, (r.shape[0], dim), self.dtype) for k, r in rows.items()]
        request, statuses = self._lookup("store", items, prefetch=False, reserve=True)
        try:
            found = list(zip(items, statuses, strict=True))
            keys = [i.key for i, s in found if s.status is Status.RESERVED]
            present = [i.key for i, s in found if s.status is Status.HIT]
            if present:
                request.publish(present)
            if not keys:
                request.close()
                return []
            staged = self._stage(request, keys, [rows[k] for k in keys])
        except BaseException:
            request.close()
            raise
        self._holds.add_staged(staged, time.monotonic() + self.hold_timeout_s)
        return [StoreHandle(staged, key) for key in keys]

    def wait_store_to_pool(self, handles: list[StoreHandle]) -> None:
        """Finish the staging copies, make the entries READY and start their publish."""
        errors: list[BaseException] = []
        for staged in dict.fromkeys(h.staged for h in handles):
            if not self._holds.claim(staged):
                logger.warning("wait_store_to_pool: a staged store expired; nothing inserted")
                continue
            try:
                for event in staged.events:
                    event.synchronize()
                staged.request.insert(staged.keys, staged.tensors, publish=True)
            except Exception as exc:
                errors.append(exc)
            finally:
                staged.request.close()
        if errors:
            raise errors[0]

    def insert_batch(self, mm_hashes: list[str], modality: Any = None) -> None:
        """Publish the READY entries of ``mm_hashes``: ``wait_store_to_pool`` has started every
        publish already (module docstring), so nothing is left to send."""
        if self._dims.dim_or_warn(modality, "insert_batch") is not None:
            logger.debug("insert_batch: %d hashes, published at wait_store_to_pool", len(mm_hashes))

    def get_embedding_dim(self, modality: Any = None) -> int:
        """The hidden size of ``modality``'s embeddings."""
        dim = self._dims.dim(modality)
        if dim is None:
            raise InvalidArgumentError(
                f"no embedding dim for modality {modality!r}: hidden_dims has "
                f"{self._dims.known()}; pass its dim in hidden_dims"
            )
        return dim

    def _stage(self, request: Request, keys: list[str], rows: list[torch.Tensor]) -> Staged:
        """The tensors to insert at ``wait_store_to_pool``: CPU rows as they are (in the pool's
        dtype), CUDA rows copied to pinned host memory on the side stream of their device."""
        staged = Staged(request, keys, [])
        devices: dict[str, torch.device] = {}
        for row in rows:
            if row.device.type != "cuda":
                staged.tensors.append(row.to(self.dtype))
                continue
            stream = self._stream(row.device)
            if str(row.device) not in devices:
                devices[str(row.device)] = row.device
                stream.wait_stream(torch.cuda.current_stream(row.device))
            host = torch.empty(row.shape, dtype=self.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(row, non_blocking=True)
            row.record_stream(stream)
            staged.sources.append(row)
            staged.tensors.append(host)
        for device in devices.values():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream(device))
            staged.events.append(event)
        return staged

    def _copy(self, source: torch.Tensor, target: torch.Tensor) -> Any:
        """Copy pool rows into ``target``: on the side stream with an event for CUDA."""
        if target.device.type != "cuda":
            target.copy_(source)
            return None
        stream = self._stream(target.device)
        stream.wait_stream(torch.cuda.current_stream(target.device))
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event
