"""SGLang 0.5.23 ``MMEncoder``'s use of its cache controller, replayed call by call (our code).

``serve`` follows ``_compute_global_cache_embedding`` of ``sglang/srt/disaggregation/encoder/
server.py``: the same calls, in the same order, on the same ranks, with the same two int32 mask
broadcasts over ``controller.prefetch_tp_group``, the same exception handling (a failed lookup
or prefetch turns into misses or fallbacks), the 5 ms polling, the CPU output path
(``get_pool_views``/``release_pool_views`` in a ``finally``) and the GPU one
(``load_to_device_async``/``wait_load_to_device``, here into a CPU tensor), and the background
``wait_store_to_pool`` + ``insert_batch``. ``serve_legacy`` is the older method set's request.
The SGLang adapter's tests (``tests/sglang_controller/``) and the memory soak's ``sglang`` front end
(``benchmarks/soak/memory.py``) drive the controller through it.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DIM = 16
DTYPE = torch.bfloat16


class Modality(enum.Enum):
    """SGLang's ``Modality`` members that the controller reads (it compares by name)."""

    IMAGE = enum.auto()
    MULTI_IMAGES = enum.auto()
    VIDEO = enum.auto()
    AUDIO = enum.auto()


def embedding(key: str, tokens: int) -> torch.Tensor:
    """The encoder's output for ``key``: distinct, deterministic bytes per key."""
    seed = sum(map(ord, key)) * 131 + tokens
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((tokens, DIM), generator=generator).to(DTYPE)


@dataclass
class Encoder:
    """Every rank runs it on the masked items (the ViT); it records what it was asked."""

    calls: list[list[str]] = field(default_factory=list)

    def __call__(self, keys: Sequence[str], tokens: Sequence[int]) -> list[torch.Tensor]:
        self.calls.append(list(keys))
        return [embedding(k, n) for k, n in zip(keys, tokens, strict=True)]


@dataclass
class Served:
    """What one request produced: masks (every rank), output and insert thread (rank 0)."""

    exist_mask: list[int]
    fallback_mask: list[int]
    output: torch.Tensor | None = None
    insert_thread: threading.Thread | None = None
    insert_errors: list[BaseException] = field(default_factory=list)

    def finish(self) -> None:
        """Join the background insert; re-raise what it raised."""
        if self.insert_thread is not None:
            self.insert_thread.join(30)
            assert not self.insert_thread.is_alive(), "background insert hung"
        if self.insert_errors:
            raise self.insert_errors[0]


def _broadcast(controller: Any, world: int, mask: torch.Tensor) -> None:
    if world > 1:
        dist.broadcast(mask, src=0, group=controller.prefetch_tp_group)


def serve(
    controller: Any,
    rank: int,
    world: int,
    req_id: str,
    keys: Sequence[str],
    tokens: Sequence[int],
    encoder: Encoder,
    *,
    gpu_output: bool = False,
    prefetch_timeout_s: float = 60.0,
    after_lookup: Callable[[], None] | None = None,
    fail_between: Callable[[], None] | None = None,
) -> Served:
    """One MMEncoder request. On rank 0, ``after_lookup`` runs after the first broadcast (a
    test kills the master there) and ``fail_between`` raises after the fallback mask, as an
    encoder or assembly failure would."""
    n = len(keys)
    modality = Modality.IMAGE
    if rank == 0:
        try:
            exist = asyncio.run(controller.batch_is_exist(list(keys)))
        except Exception:
            exist = [False] * n
        mask = torch.tensor([1 if e else 0 for e in exist], dtype=torch.int32)
    else:
        mask = torch.zeros(n, dtype=torch.int32)
    _broadcast(controller, world, mask)
    hits = [i for i in range(n) if mask[i].item() == 1]
    misses = [i for i in range(n) if mask[i].item() != 1]
    if rank == 0 and after_lookup is not None:
        after_lookup()

    hit_keys: list[str] = []
    prefetch_failed = False
    if rank == 0 and hits:
        hit_keys = [keys[i] for i in hits]
        try:
            controller.prefetch(req_id, hit_keys, [tokens[i] for i in hits], modality)
        except Exception:
            hit_keys, prefetch_failed = [], True

    new = encoder([keys[i] for i in misses], [tokens[i] for i in misses]) if misses else []
    staged_keys: list[str] = []
    handles: list[Any] = []

    def stage(indices: list[int], slices: list[torch.Tensor]) -> None:
        if not slices:
            return
        chosen = [keys[i] for i in indices]
        try:
            got = controller.store_to_pool_async(chosen, slices, modality)
        except Exception:
            return
        staged_keys.extend(chosen)
        handles.extend(got)

    if rank == 0 and not gpu_output:
        stage(misses, new)

    fallback_mask = torch.zeros(n, dtype=torch.int32)
    if rank == 0 and hits:
        if prefetch_failed:
            fallback_mask[hits] = 1
        else:
            try:
                _poll(controller, req_id, prefetch_timeout_s)
                for i, key in zip(hits, hit_keys, strict=True):
                    if not controller.has_local_embedding(key):
                        fallback_mask[i] = 1
            except Exception:
                fallback_mask[hits] = 1
    _broadcast(controller, world, fallback_mask)
    fallbacks = [i for i in range(n) if fallback_mask[i].item() == 1]
    served = Served(mask.tolist(), fallback_mask.tolist())

    redone = (
        encoder([keys[i] for i in fallbacks], [tokens[i] for i in fallbacks]) if fallbacks else []
    )
    if rank != 0:
        return served
    if fail_between is not None:
        fail_between()
    if gpu_output:
        stage(misses, new)
        stage(fallbacks, redone)
        served.output = _assemble_by_copies(
            controller, keys, tokens, misses, new, fallbacks, redone
        )
    else:
        stage(fallbacks, redone)
        served.output = _assemble_from_views(
            controller, keys, tokens, hits, misses, new, fallbacks, redone
        )
    if staged_keys:
        served.insert_thread = threading.Thread(
            target=_background_insert, args=(controller, staged_keys, handles, served), daemon=True
        )
        served.insert_thread.start()
    return served


def _poll(controller: Any, req_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not controller.check_prefetch_progress(req_id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefetch of {req_id} still running after {timeout_s} s")
        time.sleep(0.005)


def _assemble_from_views(
    controller: Any,
    keys: Sequence[str],
    tokens: Sequence[int],
    hits: list[int],
    misses: list[int],
    new: list[torch.Tensor],
    fallbacks: list[int],
    redone: list[torch.Tensor],
) -> torch.Tensor:
    dim = controller.get_embedding_dim(Modality.IMAGE)
    out = torch.empty((sum(tokens), dim), dtype=DTYPE)
    view_keys = [keys[i] for i in hits if i not in fallbacks]
    views: dict[str, list[torch.Tensor]] = {}
    try:
        if view_keys:
            for key, slices in zip(view_keys, controller.get_pool_views(view_keys), strict=True):
                if slices is None:
                    raise RuntimeError(f"cached embedding {key} not available")
                views[key] = slices
        offset = 0
        for i, n in enumerate(tokens):
            if i in misses:
                out[offset : offset + n].copy_(new[misses.index(i)])
            elif i in fallbacks:
                out[offset : offset + n].copy_(redone[fallbacks.index(i)])
            else:
                copied = 0
                for view in views[keys[i]]:
                    out[offset + copied : offset + copied + view.shape[0]].copy_(view)
                    copied += view.shape[0]
            offset += n
        return out
    finally:
        if view_keys:
            controller.release_pool_views(view_keys)


def _assemble_by_copies(
    controller: Any,
    keys: Sequence[str],
    tokens: Sequence[int],
    misses: list[int],
    new: list[torch.Tensor],
    fallbacks: list[int],
    redone: list[torch.Tensor],
) -> torch.Tensor:
    dim = controller.get_embedding_dim(Modality.IMAGE)
    out = torch.empty((sum(tokens), dim), dtype=DTYPE)
    offset = 0
    handles = []
    for i, n in enumerate(tokens):
        if i in misses:
            out[offset : offset + n].copy_(new[misses.index(i)])
        elif i in fallbacks:
            out[offset : offset + n].copy_(redone[fallbacks.index(i)])
        else:
            handle = controller.load_to_device_async(keys[i], out, offset)
            if handle is None:
                raise RuntimeError(f"cached embedding {keys[i]} disappeared during assembly")
            handles.append(handle)
        offset += n
    controller.wait_load_to_device(handles)
    return out


def _background_insert(
    controller: Any, keys: list[str], handles: list[Any], served: Served
) -> None:
    try:
        controller.wait_store_to_pool(handles)
        controller.insert_batch(keys, Modality.IMAGE)
    except BaseException as exc:
        served.insert_errors.append(exc)


def serve_legacy(
    controller: Any,
    rank: int,
    world: int,
    req_id: str,
    keys: Sequence[str],
    tokens: Sequence[int],
    encoder: Encoder,
) -> Served:
    """One request of the older method set: the same lookup, prefetch and masks, then
    ``get_embeddings`` of the hits (None: encode it), ``insert_batch`` of the fresh outputs,
    ``release_embeddings``."""
    n = len(keys)
    if rank == 0:
        exist = asyncio.run(controller.batch_is_exist(list(keys)))
        mask = torch.tensor([1 if e else 0 for e in exist], dtype=torch.int32)
    else:
        mask = torch.zeros(n, dtype=torch.int32)
    _broadcast(controller, world, mask)
    hits = [i for i in range(n) if mask[i].item() == 1]
    misses = [i for i in range(n) if mask[i].item() != 1]
    if rank == 0 and hits:
        controller.prefetch(
            req_id, [keys[i] for i in hits], [tokens[i] for i in hits], Modality.IMAGE
        )
    new = encoder([keys[i] for i in misses], [tokens[i] for i in misses]) if misses else []
    fallback_mask = torch.zeros(n, dtype=torch.int32)
    views: list[torch.Tensor | None] = []
    if rank == 0 and hits:
        _poll(controller, req_id, 60.0)
        views = controller.get_embeddings([keys[i] for i in hits])
        for i, view in zip(hits, views, strict=True):
            if view is None:
                fallback_mask[i] = 1
    _broadcast(controller, world, fallback_mask)
    fallbacks = [i for i in range(n) if fallback_mask[i].item() == 1]
    redone = (
        encoder([keys[i] for i in fallbacks], [tokens[i] for i in fallbacks]) if fallbacks else []
    )
    served = Served(mask.tolist(), fallback_mask.tolist())
    if rank != 0:
        return served
    try:
        fresh = {keys[i]: t for i, t in zip(misses + fallbacks, new + redone, strict=True)}
        if fresh:
            controller.insert_batch(list(fresh), list(fresh.values()))
        parts = []
        for i, n_tokens in enumerate(tokens):
            view = views[hits.index(i)] if i in hits else None
            part = fresh[keys[i]] if view is None else view
            assert part.shape == (n_tokens, DIM), (keys[i], part.shape)
            parts.append(part)
        served.output = torch.cat(parts)
    finally:
        got = [keys[i] for i, view in zip(hits, views, strict=True) if view is not None]
        if got:
            controller.release_embeddings(got)
    controller.get_stats()
    return served
