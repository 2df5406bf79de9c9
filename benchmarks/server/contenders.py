"""The encode servers the server benchmark compares: one request in, its embeddings out.

Every contender gets the same images and its own ``MeteredEncoder`` around one shared
``TinyViT``, and serves a request as its serving stack would:
- ``NoCache``: every image encoded;
- ``MMEncoderServer``: SGLang 0.5.23 ``MMEncoder``'s sequence on rank 0 with the CPU output
  path (``batch_is_exist``; ``prefetch`` of the hits; encode the misses; ``store_to_pool_async``
  of them; ``check_prefetch_progress`` polled every 5 ms; ``has_local_embedding`` per hit, the
  items it denies encoded and staged too; ``get_pool_views``, the copy into the output,
  ``release_pool_views``; ``wait_store_to_pool`` + ``insert_batch`` on a background thread), on
  SGLang's own controller (from the wheel, its CPU store step as in
  ``benchmarks.peers.bench_sglang_adapter``) or on embcache's (``embcache.integrations.sglang``);
- ``OriginalPRServer`` (``original PR direct``): the same lookup and reads on the original PR's
  controller (``tests.support.baselines.OriginalPRController``) called directly, fresh outputs
  inserted one by one on the request's thread: no asyncio hop, no background insert;
- ``original_pr_server`` (``original PR in MMEncoder``): the same controller behind SGLang's
  method names (``OriginalPRSequence``), driven through MMEncoder's sequence above like the
  other two: the same event-loop hop for ``batch_is_exist`` (its misses asked of a null global
  store off the loop, as SGLang's and embcache's controllers ask theirs), and its inserts on
  the background thread (``wait_store_to_pool``);
- ``PipelineServer``: ``EncodePipeline.encode`` on an ``EmbeddingCache``.

A request that fails (SGLang's controller can evict a hit between ``has_local_embedding`` and
``get_pool_views``: MMEncoder then raises) is counted, not retried. ``cache_seconds`` of a
request is the time spent in cache calls, including the polling, the copies out of the pool and
building the response (allocating it and copying the fresh outputs in: the pipeline does that
inside ``encode``, whose time minus its encoder time is its cache time, so every contender's
cache time counts it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.peers.bench_sglang_adapter import NullGlobalStore, SGLangSide, Size
from benchmarks.server.workload import MeteredEncoder
from embcache import EmbeddingCache, EncodePipeline, GlobalStore
from embcache.integrations.sglang import EmbeddingCacheController
from tests.support.baselines import OriginalPRController
from tests.support.breakdown import Profiles
from tests.support.server_workload import Image

POLL_S = 0.005  # MMEncoder's prefetch polling
ORIGINAL_PR_DIRECT = "original PR direct"
ORIGINAL_PR_MMENCODER = "original PR in MMEncoder"


@dataclass(frozen=True)
class Served:
    """One request's answer: the embeddings (items concatenated in order) and its times."""

    embeddings: torch.Tensor
    seconds: float
    cache_seconds: float


class Lane:
    """One client thread's own state: an event loop for the controllers' async calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()


class Contender:
    """One encode server; subclasses implement ``_serve``."""

    name = ""

    def __init__(self, encoder: MeteredEncoder) -> None:
        self.encoder = encoder
        self.counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._clock = threading.local()
        self.profiles: Profiles | None = None  # set: profile the cache calls (breakdown)

    def serve(self, request_id: str, images: Sequence[Image], lane: Lane) -> Served:
        """Serve one request. Raises what the request raised."""
        self.encoder.start_request()
        self._clock.seconds = 0.0
        start = time.perf_counter()
        out = self._serve(request_id, images, lane)
        seconds = time.perf_counter() - start
        assert out.shape == (sum(i.tokens for i in images), images[0].item.shape[1]), out.shape
        return Served(out, seconds, self._cache_seconds(seconds))

    def finish(self) -> None:
        """Wait for the background work of the requests served so far."""

    def failed_inserts(self) -> int:
        """Fresh outputs the cache could not place (no space), so far."""
        return 0

    def admissions_refused(self) -> int:
        """Fresh outputs the cache's policy chose not to keep, so far."""
        return 0

    def single_flight_seconds(self) -> float:
        """Seconds its requests waited for another request's encode of the same image, so
        far (only the pipeline times them, from its own counter; the peers' waits, 0.1-0.2
        ms a request in the breakdown, stay in their cache time)."""
        return 0.0

    def close(self) -> None:
        """Stop the server's threads and free its pool."""

    def _serve(self, request_id: str, images: Sequence[Image], lane: Lane) -> torch.Tensor:
        raise NotImplementedError

    def _cache_seconds(self, seconds: float) -> float:
        return float(self._clock.seconds)

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            if self.profiles is None:
                return call()
            with self.profiles.on():
                return call()
        finally:
            self._clock.seconds += time.perf_counter() - start

    def profile(self, profiles: Profiles) -> None:
        """Profile every cache call from now on (the encoder's calls left out)."""
        self.profiles = self.encoder.profiles = profiles

    def _count(self, **amounts: int) -> None:
        with self._counts_lock:
            self.counts.update(amounts)


class NoCache(Contender):
    """Every image encoded, every request."""

    name = "no cache"

    def _serve(self, request_id: str, images: Sequence[Image], lane: Lane) -> torch.Tensor:
        return torch.cat(self.encoder([i.pixels for i in images]))


class MMEncoderServer(Contender):
    """MMEncoder's sequence (module docstring) on ``controller``."""

    def __init__(
        self, name: str, encoder: MeteredEncoder, controller: Any, modality: Any, close: Any
    ) -> None:
        super().__init__(encoder)
        self.name = name
        self.controller = controller
        self.modality = modality
        self._close = close
        self._inserts: list[threading.Thread] = []
        self._inserts_lock = threading.Lock()
        self.errors: list[BaseException] = []

    def _serve(self, request_id: str, images: Sequence[Image], lane: Lane) -> torch.Tensor:
        c, timed = self.controller, self._timed
        keys = [i.key for i in images]
        tokens = [i.tokens for i in images]
        exist = timed(lambda: lane.loop.run_until_complete(c.batch_is_exist(keys)))
        hits = [n for n, e in enumerate(exist) if e]
        misses = [n for n, e in enumerate(exist) if not e]
        prefetch_failed = False
        if hits:
            try:
                hit_tokens = [tokens[n] for n in hits]
                timed(
                    lambda: c.prefetch(
                        request_id, [keys[n] for n in hits], hit_tokens, self.modality
                    )
                )
            except Exception:
                prefetch_failed = True
        new = self.encoder([images[n].pixels for n in misses]) if misses else []
        staged: list[str] = []
        handles: list[Any] = []
        self._stage(images, misses, new, staged, handles)
        fallbacks = hits if prefetch_failed else []
        if hits and not prefetch_failed:
            fallbacks = timed(lambda: self._poll(request_id, [keys[n] for n in hits], hits))
        redone = self.encoder([images[n].pixels for n in fallbacks]) if fallbacks else []
        self._stage(images, fallbacks, redone, staged, handles)
        try:
            return self._assemble(
                images, hits, fallbacks, dict(zip(misses + fallbacks, new + redone, strict=True))
            )
        finally:
            if staged:
                self._insert_in_background(staged, handles)

    def _poll(self, request_id: str, hit_keys: list[str], hits: list[int]) -> list[int]:
        c = self.controller
        while not c.check_prefetch_progress(request_id):
            time.sleep(POLL_S)
        return [n for n, key in zip(hits, hit_keys, strict=True) if not c.has_local_embedding(key)]

    def _stage(
        self,
        images: Sequence[Image],
        chosen: list[int],
        tensors: list[torch.Tensor],
        staged: list[str],
        handles: list[Any],
    ) -> None:
        if not chosen:
            return
        keys = [images[n].key for n in chosen]
        try:
            got = self._timed(
                lambda: self.controller.store_to_pool_async(keys, tensors, self.modality)
            )
        except Exception:
            return
        staged.extend(keys)
        handles.extend(got)
        self._count(offered_bytes=sum(images[n].nbytes for n in chosen))

    def _assemble(
        self,
        images: Sequence[Image],
        hits: list[int],
        fallbacks: list[int],
        fresh: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        c = self.controller
        response: tuple[torch.Tensor, list[int]] = self._timed(lambda: _response(images, fresh))
        out, offsets = response
        served = [n for n in hits if n not in fallbacks]
        if not served:
            return out
        keys = [images[n].key for n in served]

        def read() -> None:
            got = c.get_pool_views(keys)
            try:
                for n, slices in zip(served, got, strict=True):
                    if slices is None:
                        raise RuntimeError(f"cached embedding {images[n].key} not available")
                    at = offsets[n]
                    for view in slices:
                        out[at : at + view.shape[0]].copy_(view)
                        at += view.shape[0]
            finally:
                c.release_pool_views(keys)

        self._timed(read)
        self._count(hit_items=len(served), read_bytes=sum(images[n].nbytes for n in served))
        return out

    def _insert_in_background(self, keys: list[str], handles: list[Any]) -> None:
        def insert() -> None:
            try:
                self.controller.wait_store_to_pool(handles)
                self.controller.insert_batch(keys, self.modality)
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=insert, daemon=True)
        thread.start()
        with self._inserts_lock:
            self._inserts.append(thread)

    def finish(self) -> None:
        with self._inserts_lock:
            threads, self._inserts = self._inserts, []
        for thread in threads:
            thread.join()
        if self.errors:
            raise self.errors[0]

    def failed_inserts(self) -> int:
        stats = self.controller.get_stats()
        ours = stats.get("embcache")
        if ours is None:
            return int(stats["allocation_failures"])
        return int(sum(ours["allocation_failures_by_reason"].values()) - ours["admissions_refused"])

    def admissions_refused(self) -> int:
        ours = self.controller.get_stats().get("embcache")
        return 0 if ours is None else int(ours["admissions_refused"])

    def close(self) -> None:
        self.finish()
        self._close()


def sglang_server(encoder: MeteredEncoder, pool_bytes: int, page_bytes: int) -> MMEncoderServer:
    """SGLang 0.5.23's controller from the wheel, pages of about ``page_bytes``, a null store.
    Raises ``sglang_wheel.SGLangUnavailable`` without the wheel."""
    dim = encoder.encoder.hidden_size
    row = dim * encoder.encoder.dtype.itemsize
    size = Size("server", 1, dim, 1, pool_bytes // row, page_bytes)
    side = SGLangSide(size)
    return MMEncoderServer("SGLang 0.5.23", encoder, side, side.modality, side.close)


def adapter_server(encoder: MeteredEncoder, pool_bytes: int, policy: str) -> MMEncoderServer:
    """embcache's SGLang controller with ``policy``, a null global store."""
    controller_class = type(
        f"{policy}Controller", (EmbeddingCacheController,), {"cache_policy": policy}
    )
    controller = controller_class(
        NullGlobalStore(),
        max_pool_size_gb=pool_bytes / (1 << 30),
        hidden_dims={"IMAGE": encoder.encoder.hidden_size},
        dtype=encoder.encoder.dtype,
    )
    return MMEncoderServer(
        f"embcache adapter {policy}", encoder, controller, "IMAGE", controller.close
    )


class OriginalPRSequence:
    """The original PR's controller (``OriginalPRController``) behind the SGLang 0.5.23 methods
    that ``MMEncoderServer`` calls, each mapped onto its own call: ``batch_is_exist`` (the
    misses then asked of a global store that holds nothing, on a worker thread, as SGLang's
    controller asks its store), ``prefetch``, ``check_prefetch_progress``,
    ``has_local_embedding`` (the key is cached; not pinned, as in SGLang, so a read can still
    find it evicted), ``get_pool_views`` (one view per hash) and ``release_pool_views``.
    ``store_to_pool_async`` stages the fresh tensors of absent keys; ``wait_store_to_pool``
    inserts them one by one (on MMEncoder's background thread); ``insert_batch`` has no store to
    publish to. Failed inserts (no space) are counted as ``allocation_failures``.

    The original PR's entry exists from its allocation on, before its bytes are copied in (its
    inserts ran on the request's thread). With the inserts on the background thread, a key
    staged and not yet inserted counts as absent here (SGLang's FILLING): every answer says
    False for it, and a view taken of it is given back and answered None. Without that, a
    request read another's half-copied entry (the verify part's answers differed)."""

    def __init__(self, pool_bytes: int) -> None:
        self.controller = OriginalPRController(pool_bytes)
        self._lock = threading.Lock()
        self._failed = 0
        self._filling: Counter[str] = Counter()  # staged, not yet inserted (all copies done)

    async def batch_is_exist(self, keys: list[str]) -> list[bool]:
        found = self._ready(keys, self.controller.batch_is_exist(keys))
        missing = [n for n, hit in enumerate(found) if not hit]
        if missing:
            stored = await asyncio.to_thread(_stored_nowhere, [keys[n] for n in missing])
            for n, exists in zip(missing, stored, strict=True):
                found[n] = exists
        return found

    def prefetch(self, req_id: str, keys: list[str], tokens: list[int], modality: Any) -> None:
        self.controller.prefetch(req_id, keys)

    def check_prefetch_progress(self, req_id: str) -> bool:
        return self.controller.check_prefetch_progress(req_id)

    def has_local_embedding(self, key: str) -> bool:
        controller = self.controller
        with controller.lock:
            present = key in controller.entries
        return self._ready([key], [present])[0]

    def get_pool_views(self, keys: list[str]) -> list[list[torch.Tensor] | None]:
        views = self.controller.get_pool_views(keys)  # pinned first, then checked
        ready = self._ready(keys, [v is not None for v in views])
        unready = [
            k for k, v, ok in zip(keys, views, ready, strict=True) if v is not None and not ok
        ]
        if unready:
            self.controller.release_pool_views(unready)
        return [[v] if ok and v is not None else None for v, ok in zip(views, ready, strict=True)]

    def release_pool_views(self, keys: list[str]) -> None:
        self.controller.release_pool_views(keys)

    def store_to_pool_async(
        self, keys: list[str], tensors: list[torch.Tensor], modality: Any
    ) -> list[tuple[str, torch.Tensor]]:
        controller = self.controller
        with controller.lock:
            absent = [k not in controller.entries for k in keys]
        staged = [(k, t) for k, t, new in zip(keys, tensors, absent, strict=True) if new]
        with self._lock:
            self._filling.update(k for k, _ in staged)
        return staged

    def wait_store_to_pool(self, handles: list[tuple[str, torch.Tensor]]) -> None:
        controller = self.controller
        failed = 0
        for key, tensor in handles:
            failed += not controller.insert(key, tensor) and key not in controller.entries
        with self._lock:
            self._failed += failed
            self._filling.subtract(k for k, _ in handles)
            for key, _ in handles:
                if self._filling[key] <= 0:
                    del self._filling[key]

    def insert_batch(self, keys: list[str], modality: Any) -> None:
        """No global store: nothing to publish."""

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            return {"allocation_failures": self._failed}

    def _ready(self, keys: list[str], present: list[bool]) -> list[bool]:
        """``present``, False where the key is staged and not yet inserted."""
        with self._lock:
            filling = self._filling
            return [p and k not in filling for k, p in zip(keys, present, strict=True)]


def _stored_nowhere(keys: list[str]) -> list[bool]:
    """A global store that holds nothing (``NullGlobalStore.exists``, SGLang's ``NullStore``)."""
    return [False] * len(keys)


def original_pr_server(encoder: MeteredEncoder, pool_bytes: int) -> MMEncoderServer:
    """The original PR's controller driven through MMEncoder's sequence (``OriginalPRSequence``)."""
    controller = OriginalPRSequence(pool_bytes)
    return MMEncoderServer(ORIGINAL_PR_MMENCODER, encoder, controller, "IMAGE", lambda: None)


class OriginalPRServer(Contender):
    """The original PR's controller called directly: lookup, prefetch, views of the hits,
    inserts one by one on the request's thread."""

    name = ORIGINAL_PR_DIRECT

    def __init__(self, encoder: MeteredEncoder, pool_bytes: int) -> None:
        super().__init__(encoder)
        self.controller = OriginalPRController(pool_bytes)
        self._failed = 0

    def _serve(self, request_id: str, images: Sequence[Image], lane: Lane) -> torch.Tensor:
        c, timed = self.controller, self._timed
        keys = [i.key for i in images]
        exist = timed(lambda: c.batch_is_exist(keys))
        hits = [n for n, e in enumerate(exist) if e]
        views: list[torch.Tensor | None] = []
        if hits:
            hit_keys = [keys[n] for n in hits]

            def lookup() -> list[torch.Tensor | None]:
                c.prefetch(request_id, hit_keys)
                while not c.check_prefetch_progress(request_id):
                    time.sleep(POLL_S)
                return c.get_pool_views(hit_keys)

            views = timed(lookup)
        held = {n: v for n, v in zip(hits, views, strict=True) if v is not None}
        encode = [n for n in range(len(images)) if n not in held]
        try:
            new = self.encoder([images[n].pixels for n in encode]) if encode else []
            timed(lambda: self._insert(images, encode, new))
            response: tuple[torch.Tensor, list[int]] = timed(
                lambda: _response(images, dict(zip(encode, new, strict=True)))
            )
            out, offsets = response
            for n, view in held.items():
                timed(lambda: out[offsets[n] : offsets[n + 1]].copy_(view))  # noqa: B023
            self._count(hit_items=len(held), read_bytes=sum(images[n].nbytes for n in held))
            return out
        finally:
            if held:
                timed(lambda: c.release_pool_views([keys[n] for n in held]))

    def _insert(self, images: Sequence[Image], chosen: list[int], new: list[torch.Tensor]) -> None:
        c = self.controller
        for n, tensor in zip(chosen, new, strict=True):
            if not c.insert(images[n].key, tensor) and images[n].key not in c.entries:
                self._count(failed=1)
        self._count(offered_bytes=sum(images[n].nbytes for n in chosen))

    def failed_inserts(self) -> int:
        return self.counts["failed"]


class PipelineServer(Contender):
    """``EncodePipeline.encode`` on an ``EmbeddingCache`` with ``policy``."""

    def __init__(
        self,
        encoder: MeteredEncoder,
        pool_bytes: int,
        policy: str,
        store: GlobalStore | None = None,
    ) -> None:
        super().__init__(encoder)
        self.name = f"embcache pipeline {policy}"
        self.cache = EmbeddingCache(pool_bytes, store=store, policy=policy)  # None: no tier
        self.pipeline = EncodePipeline(self.cache, encoder)

    def _serve(self, request_id: str, images: Sequence[Image], lane: Lane) -> torch.Tensor:
        items, pixels = [i.item for i in images], [i.pixels for i in images]
        if self.profiles is None:
            out = self.pipeline.encode(request_id, items, pixels)
        else:
            with self.profiles.on():
                out = self.pipeline.encode(request_id, items, pixels)
        encoded = self.encoder.request_tokens()
        row = images[0].nbytes // images[0].tokens
        tokens = sum(i.tokens for i in images)
        self._count(read_bytes=(tokens - encoded) * row, offered_bytes=encoded * row)
        return out

    def _cache_seconds(self, seconds: float) -> float:
        return seconds - self.encoder.request_seconds()

    def failed_inserts(self) -> int:
        stats = self.cache.stats()
        return sum(stats.allocation_failures_by_reason.values()) - stats.admissions_refused

    def admissions_refused(self) -> int:
        return self.cache.stats().admissions_refused

    def single_flight_seconds(self) -> float:
        return self.pipeline.stats().wait_seconds  # no store here: every wait is a join

    def close(self) -> None:
        self.cache.check_invariants()
        self.cache.close()


def _response(
    images: Sequence[Image], fresh: dict[int, torch.Tensor]
) -> tuple[torch.Tensor, list[int]]:
    """The response with the fresh outputs copied in (``fresh``: image index -> tensor), and
    where each image's rows start. Timed as cache time, as the pipeline's is (it builds its
    response inside ``encode``)."""
    out, offsets = _output(images), _offsets(images)
    for n, tensor in fresh.items():
        out[offsets[n] : offsets[n + 1]].copy_(tensor)
    return out, offsets


def _output(images: Sequence[Image]) -> torch.Tensor:
    """The response tensor: every item's rows, in order."""
    rows = sum(i.tokens for i in images)
    return torch.empty((rows, images[0].item.shape[1]), dtype=images[0].item.dtype)


def _offsets(images: Sequence[Image]) -> list[int]:
    """Where each item's rows start in the response, and the end."""
    offsets = [0]
    for image in images:
        offsets.append(offsets[-1] + image.tokens)
    return offsets
