"""``EncodePipeline``: what a serving engine calls to turn images into embeddings via the cache.

Theory of operation. One call, ``encode(request_id, items, inputs)``, runs these steps:

1. Rank 0 opens a cache request and looks the items up (``prefetch``: store hits start loading;
   ``reserve_misses``: misses are reserved, so concurrent calls for the same image wait for
   this call's encode), then waits at most ``prefetch_timeout`` for the loads.
2. Rank 0 takes one snapshot of what it holds (``embeddings()``): the fallback mask is exactly
   the items it does not hold (misses, reservations, failed, timed-out, quarantined loads).
   It copies each held row into its place in the answer on the encoder's device at once, so
   nothing is read from the pool after the request ends (``claims``: ``FleetClaims``).
3. With a tensor-parallel group (the collectives are ``embcache.pipeline.tp_channel``): every rank
   gathers a header (failed?, item count, item fingerprint), so a failure on any rank before
   this point, or ranks called with different items, raises on every rank; then rank 0
   broadcasts the mask and the held rows (as bytes, so any dtype travels unchanged), and each
   other rank copies them into its own answer.
4. Every rank runs the encoder on exactly the masked items (a key once per call), in item
   order, so an encoder that is itself tensor-parallel sees the same calls on each rank. With
   a group, the ranks then agree (an all-reduce) on whether every encoder call succeeded.
5. Rank 0 inserts the fresh outputs (while the request still holds its reservations, or their
   waiters would fall back) with ``publish=True``: the write to the global store runs on the
   cache's I/O pool. The request then ends, releasing every pin, wait and reservation.
6. Every rank copies the fresh outputs into the rest of its answer (rows in item order).

The result has the encoder's dtype and device whether an item came from the cache or the
encoder: the pool stores each item in its own dtype, and encoder outputs of another shape,
dtype or device are refused rather than converted.

Failure. Leaving the request's ``with`` block releases everything on every path. A rank that
fails raises its own exception; the other ranks raise ``TensorParallelError`` at the next
agreement point (the header or the encoder all-reduce), so every rank raises in the same call
and the group stays aligned for the next one. A collective that waits past
``collective_timeout`` (else the group's own timeout) raises ``TensorParallelError`` and leaves
the group unusable: rebuild it.

Threads and locks. No cache lock is held across the encoder, a wait or a collective (the cache
takes its lock only inside its own calls); the pipeline's only lock guards its counters. With a
group, every rank must call ``encode`` with the same items in the same order, one call at a
time per group (one group per concurrent stream); without one, calls may run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from embcache.core.outcomes import ItemStatus, Reason, Status
from embcache.driver.cache import EmbeddingCache
from embcache.driver.item import Item
from embcache.driver.locks import assert_unlocked
from embcache.driver.pool import bytes_only, copy_bytes
from embcache.driver.request import Request
from embcache.errors import InvalidArgumentError, InvalidTypeError, TensorParallelError
from embcache.pipeline.claims import FleetClaims
from embcache.pipeline.plan import Plan, copy_rows, make_plan
from embcache.pipeline.tp_channel import GroupChannel

__all__ = ["EncodePipeline", "Encoder", "PipelineStats", "TensorParallelError"]

T = TypeVar("T")
#: Miss reasons of a key the pool refused (its fleet claim is still worth taking: another
#: worker, or this one's copy, can publish it without the pool).
REFUSED = frozenset({Reason.NOT_ADMITTED, Reason.NO_SPACE})
logger = logging.getLogger(__name__)


@runtime_checkable
class Encoder(Protocol):
    """What the pipeline calls: one output tensor per input, on ``device``.

    Output ``i`` must have exactly the shape and dtype of the ``Item`` given for input ``i``.
    """

    @property
    def device(self) -> torch.device:
        """Where outputs are produced (and where the pipeline puts cached rows)."""
        ...

    def __call__(self, inputs: Sequence[Any], /) -> Sequence[torch.Tensor]:
        """Encode ``inputs``; one tensor per input, in order."""
        ...


@dataclass(frozen=True)
class PipelineStats:
    """Counters of one pipeline since it was made (rank 0 counts lookups; others count 0).

    ``items`` = ``local_hits`` + ``waited`` + ``fallback_items`` over successful calls.
    ``waited``: items that were LOADING at lookup and served after the wait (a store load or
    another request's encode). ``fallback_items``: items this rank encoded, by reason in
    ``fallbacks_by_reason`` (``not_found`` is a plain miss). ``encoded``: inputs given to the
    encoder (a key repeated in one call is encoded once). ``wait_seconds``: rank 0's time
    waiting for the items LOADING at lookup (a store load, or another call's encode of the same
    key: a wait that replaces an encode of its own). ``encoder_seconds``: this rank's time in
    encoder calls (wall clock around each call).
    """

    calls: int
    failed_calls: int
    items: int
    local_hits: int
    waited: int
    fallback_items: int
    fallbacks_by_reason: dict[str, int]
    encoded: int
    encoder_calls: int
    wait_seconds: float
    encoder_seconds: float


@dataclass(frozen=True)
class _Local:
    """Rank 0's view after the lookup: what to encode, why, and the rows it already has."""

    statuses: list[ItemStatus]
    mask: list[bool]  # True: encode
    reasons: list[Reason | None]
    answer: torch.Tensor  # the held items' rows in place (the masked rows unwritten), on device


class EncodePipeline:
    """Embeddings for a request's items: cached rows where held, the encoder elsewhere.

    ``cache`` is used on rank 0 of ``tp_group`` (or alone without a group); every other rank
    passes None. ``prefetch_timeout`` bounds the wait for loads from the global store; an item
    still loading then is encoded instead. ``collective_timeout`` bounds each collective
    (None: the group's own timeout). ``on_insert(items, seconds)``, if given, is called on
    rank 0 after each insert of fresh outputs (how many, how long the copy into the pool took),
    with no lock held, e.g. ``CacheMetrics.observe_insert``; what it raises is logged, never
    raised. ``claims`` (opt-in; not with ``tp_group``) claims misses fleet-wide before
    encoding them, on the cache's global store (``FleetClaims``), those the pool refused too:
    their outputs are published as copies put into the store on the calling thread, and a
    key another worker published that the pool refuses is read as a copy (a
    ``CopyingStore``). Without claims a refused output is not published. See the module
    docstring for the protocol.
    """

    def __init__(
        self,
        cache: EmbeddingCache | None,
        encoder: Encoder,
        *,
        tp_group: dist.ProcessGroup | None = None,
        prefetch_timeout: float = 60.0,
        collective_timeout: float | None = None,
        on_insert: Callable[[int, float], object] | None = None,
        claims: FleetClaims | None = None,
    ) -> None:
        if claims is not None and not isinstance(claims, FleetClaims):
            raise InvalidTypeError(f"claims must be a FleetClaims, got {type(claims).__name__}")
        if on_insert is not None and not callable(on_insert):
            raise InvalidTypeError(f"on_insert must be callable, got {type(on_insert).__name__}")
        if not callable(encoder) or not isinstance(getattr(encoder, "device", None), torch.device):
            raise InvalidTypeError(
                "encoder must be callable on a list of inputs and have a torch.device `device`, "
                f"got {type(encoder).__name__}"
            )
        _check_seconds("prefetch_timeout", prefetch_timeout)
        if collective_timeout is not None:
            _check_seconds("collective_timeout", collective_timeout)
        self._rank = 0 if tp_group is None else dist.get_rank(tp_group)
        if self._rank == 0 and not isinstance(cache, EmbeddingCache):
            raise InvalidTypeError(
                f"rank 0 needs an EmbeddingCache, got {type(cache).__name__}: rank 0 looks "
                "every item up"
            )
        if self._rank != 0 and cache is not None:
            raise InvalidArgumentError(
                f"rank {self._rank} got a cache: only rank 0 of the tensor-parallel group looks "
                "items up, pass cache=None on the other ranks"
            )
        self._cache = cache
        self._uses_work = cache is not None and cache.uses_work  # insert's work: only if used
        self._pool_address = 0 if cache is None else cache.pool.data_ptr()  # host memory
        self._encoder = encoder
        self._device = torch.empty(0, device=encoder.device).device  # "cuda" -> "cuda:0"
        self._channel = (
            None if tp_group is None else GroupChannel(tp_group, self._device, collective_timeout)
        )
        self._prefetch_timeout = prefetch_timeout
        self._on_insert = on_insert
        if claims is not None and tp_group is not None:
            raise InvalidArgumentError(
                "claims with a tensor-parallel group: not supported (the group encodes once per "
                "call; claims encode in two rounds); use claims without a group"
            )
        self._claims = claims
        self._stats_lock = threading.Lock()  # a leaf lock: guards the counters only
        self._counts: Counter[str] = Counter()
        self._wait_seconds = 0.0
        self._encoder_seconds = 0.0

    @property
    def claims(self) -> FleetClaims | None:
        """The fleet claims (None: off)."""
        return self._claims

    @property
    def rank(self) -> int:
        """This process's rank in the tensor-parallel group (0 without a group)."""
        return self._rank

    @property
    def device(self) -> torch.device:
        """The encoder's device: every result lives there."""
        return self._device

    def stats(self) -> PipelineStats:
        """A snapshot of the counters. O(reasons)."""
        with self._stats_lock:
            c, wait_seconds = Counter(self._counts), self._wait_seconds
            encoder_seconds = self._encoder_seconds
        prefix = "reason:"
        return PipelineStats(
            calls=c["calls"],
            failed_calls=c["failed_calls"],
            items=c["items"],
            local_hits=c["local_hits"],
            waited=c["waited"],
            fallback_items=c["fallback_items"],
            fallbacks_by_reason={
                k[len(prefix) :]: v for k, v in sorted(c.items()) if k.startswith(prefix)
            },
            encoded=c["encoded"],
            encoder_calls=c["encoder_calls"],
            wait_seconds=wait_seconds,
            encoder_seconds=encoder_seconds,
        )

    def encode(self, request_id: str, items: Sequence[Item], inputs: Sequence[Any]) -> torch.Tensor:
        """The embeddings of ``items`` concatenated along dim 0, in order.

        ``inputs[i]`` is what the encoder needs to encode ``items[i]``. Every item must share
        the dtype and the shape after dim 0; a key may repeat (it is encoded once). Raises the
        encoder's exception (or ``TensorParallelError`` on ranks that did not fail); the cache
        is left with no pin, wait or reservation of this call on any path.
        """
        try:
            if self._cache is None:
                result = self._follow(items, inputs)
            else:
                result = self._lead(self._cache, request_id, items, inputs)
        except BaseException:
            self._count(failed_calls=1)
            raise
        return result

    async def encode_async(
        self, request_id: str, items: Sequence[Item], inputs: Sequence[Any]
    ) -> torch.Tensor:
        """``encode`` for asyncio callers: waits for loads without blocking the event loop.

        Blocking steps (store lookups, the encoder, collectives, copies) run in worker threads.
        A cancellation takes effect once the running step ends (it may be using the request),
        so the request is still closed with nothing leaked.
        """
        try:
            if self._cache is None:
                result = await _in_thread(lambda: self._follow(items, inputs))
            else:
                result = await self._lead_async(self._cache, request_id, items, inputs)
        except BaseException:
            self._count(failed_calls=1)
            raise
        return result

    # ------------------------------------------------------------------ rank 0
    def _lead(
        self, cache: EmbeddingCache, request_id: str, items: Sequence[Item], inputs: Sequence[Any]
    ) -> torch.Tensor:
        try:
            plan = make_plan(items, inputs)
            request, statuses = cache.lookup(request_id, plan.items, reserve_misses=True)
        except BaseException:
            self._share_failure()
            raise
        with request:
            try:
                if any(s.status is Status.LOADING for s in statuses):
                    started = time.perf_counter()
                    request.wait(self._prefetch_timeout)
                    self._count_wait(time.perf_counter() - started)
                local = self._collect(request, plan, statuses)
            except BaseException:
                self._share_failure()
                raise
            if self._claims is not None:
                local, fresh = self._encode_claimed(self._claims, request, plan, local)
            else:
                self._send(plan, local)
                fresh, seconds = self._encode_fallbacks(plan, local.mask)
                self._insert(request, fresh, seconds)
        self._count_call(plan, local, len(fresh))
        return self._assemble(plan, local.mask, local.answer, fresh)

    async def _lead_async(
        self, cache: EmbeddingCache, request_id: str, items: Sequence[Item], inputs: Sequence[Any]
    ) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            try:
                plan = make_plan(items, inputs)
                request, statuses = await _in_thread(
                    lambda: cache.lookup(request_id, plan.items, reserve_misses=True)
                )
                stack.enter_context(request)
                if any(s.status is Status.LOADING for s in statuses):
                    started = time.perf_counter()
                    await request.wait_async(self._prefetch_timeout)
                    self._count_wait(time.perf_counter() - started)
                local = await _in_thread(lambda: self._collect(request, plan, statuses))
            except BaseException:
                if self._channel is not None:
                    await _in_thread(self._share_failure)
                raise
            claims = self._claims
            if claims is not None:
                local, fresh = await _in_thread(
                    lambda: self._encode_claimed(claims, request, plan, local)
                )
            else:
                if self._channel is not None:
                    await _in_thread(lambda: self._send(plan, local))
                fresh, seconds = await _in_thread(lambda: self._encode_fallbacks(plan, local.mask))
                await _in_thread(lambda: self._insert(request, fresh, seconds))
        self._count_call(plan, local, len(fresh))
        return await _in_thread(lambda: self._assemble(plan, local.mask, local.answer, fresh))

    def _collect(self, request: Request, plan: Plan, statuses: list[ItemStatus]) -> _Local:
        """One snapshot of what the request holds; each held row copied into its place in the
        answer, on the device (a copy, never a view of the pool). On the CPU the pool's bytes
        go straight into the answer's rows (no view, no ``copy_`` dispatch per item)."""
        reasons = request.fallback_reasons()  # before the snapshot: served only grows
        answer, at = plan.empty_result(self._device), plan.offsets
        if answer.is_cpu:
            held = request.offsets()
            rows = _Rows(answer)
            pool = self._pool_address
            for n, offset in enumerate(held):
                if offset is not None:
                    copy_bytes(rows.address(at[n]), pool + offset, rows.nbytes(at[n], at[n + 1]))
            return _Local(statuses, [offset is None for offset in held], reasons, answer)
        views = request.embeddings()
        for n, view in enumerate(views):
            if view is not None:
                copy_rows(answer[at[n] : at[n + 1]], view)
        return _Local(statuses, [view is None for view in views], reasons, answer)

    def _encode_claimed(
        self, claims: FleetClaims, request: Request, plan: Plan, local: _Local
    ) -> tuple[_Local, dict[str, torch.Tensor]]:
        """With fleet claims (no group): claim the misses this request reserved and those its
        pool refused (``REFUSED``: the store may hold them, the pool cannot take them); encode
        and insert what it claimed and every other miss first; then wait for the keys other
        workers claimed, load what they publish (a key the pool does not take, as a copy) and
        encode what the wait leaves. The snapshot (its answer holding the loaded rows, its
        mask every item encoded) and the outputs."""
        reserved = {
            item.key: item
            for item, status, masked in zip(plan.items, local.statuses, local.mask, strict=True)
            if masked and (status.status is Status.RESERVED or status.reason in REFUSED)
        }
        mine, waiting = claims.claim(list(reserved))
        later = set(waiting)
        first = [
            masked and it.key not in later
            for it, masked in zip(plan.items, local.mask, strict=True)
        ]
        fresh = self._encode_under(claims, request, plan, first, mine)
        if not waiting:
            return local, fresh
        settled = claims.wait(request, [reserved[key] for key in waiting])
        loaded = set(settled.loaded)
        second = [it.key in later and it.key not in loaded for it in plan.items]
        answer = local.answer
        if len(loaded) > len(settled.copies):
            answer = self._collect(request, plan, local.statuses).answer
        at = plan.offsets
        for n, it in enumerate(plan.items):
            data = settled.copies.get(it.key)
            if data is not None:  # the object's bytes into the item's rows (contiguous)
                answer[at[n] : at[n + 1]].view(torch.uint8).view(-1).copy_(data)
        fresh |= self._encode_under(claims, request, plan, second, settled.mine)
        mask = [a or b for a, b in zip(first, second, strict=True)]
        return _Local(local.statuses, mask, local.reasons, answer), fresh

    def _encode_under(
        self, claims: FleetClaims, request: Request, plan: Plan, mask: list[bool], mine: list[str]
    ) -> dict[str, torch.Tensor]:
        """Encode and insert the masked items; end the claims ``mine`` after their publish:
        the pool's for the keys it took, a copy of the output into the store for the others
        (``FleetClaims.publish_copies``; released now where the copy fails); now if the
        encoder raised."""
        try:
            fresh, seconds = self._encode_fallbacks(plan, mask)
            cached = set(self._insert(request, fresh, seconds))
        except BaseException:
            claims.release(mine)
            raise
        claims.published([key for key in mine if key in cached])
        claims.publish_copies({key: fresh[key] for key in mine if key not in cached})
        return fresh

    def _insert(
        self, request: Request, fresh: dict[str, torch.Tensor], seconds: float
    ) -> list[str]:
        """Copy fresh outputs into the pool, each with its share of the encoder's ``seconds``
        when the cache's policy uses work (the cost model's assumption: one call costs the same
        per row for every item in it, so an item's share is its rows / the call's rows); their
        publish runs on the cache's I/O pool. The keys the pool took."""
        if not fresh:
            return []
        tensors = list(fresh.values())
        work = _shares(seconds, tensors) if self._uses_work else None
        started = time.perf_counter()
        took = request.insert(list(fresh), tensors, publish=True, work=work)
        if self._on_insert is not None:
            try:
                self._on_insert(len(fresh), time.perf_counter() - started)
            except Exception:
                logger.exception("on_insert raised; the call goes on")
        return [key for key, ok in zip(fresh, took, strict=True) if ok]

    # ------------------------------------------------------------------ other ranks
    def _follow(self, items: Sequence[Item], inputs: Sequence[Any]) -> torch.Tensor:
        try:
            plan = make_plan(items, inputs)
        except BaseException:
            self._share_failure()
            raise
        assert self._channel is not None  # a rank other than 0 has a group
        answer = plan.empty_result(self._device)
        mask = self._channel.receive(plan, answer)
        fresh, _ = self._encode_fallbacks(plan, mask)
        with self._stats_lock:
            self._counts.update(calls=1, encoded=len(fresh), encoder_calls=int(bool(fresh)))
        return self._assemble(plan, mask, answer, fresh)

    # ------------------------------------------------------------------ every rank
    def _encode_fallbacks(
        self, plan: Plan, mask: list[bool]
    ) -> tuple[dict[str, torch.Tensor], float]:
        """Run the encoder on the masked items (each key once); every rank agrees it worked.
        The outputs and the call's seconds (wall clock around the call: on an asynchronous
        device, what the encoder waits for before it returns)."""
        items, inputs = plan.fallbacks(mask)
        if not items:
            return {}, 0.0
        try:
            started = time.perf_counter()
            fresh = self._call_encoder(items, inputs)
            seconds = time.perf_counter() - started
        except BaseException:
            self._agree_encoded(failed=True)
            raise
        with self._stats_lock:
            self._encoder_seconds += seconds
        self._agree_encoded(failed=False)
        return fresh, seconds

    def _call_encoder(self, items: list[Item], inputs: list[Any]) -> dict[str, torch.Tensor]:
        assert_unlocked("encoder call")
        with torch.no_grad():
            outputs = list(self._encoder(inputs))
        if len(outputs) != len(items):
            raise InvalidArgumentError(
                f"the encoder returned {len(outputs)} tensors for {len(items)} inputs: it must "
                "return one per input"
            )
        for item, out in zip(items, outputs, strict=True):
            if (
                not isinstance(out, torch.Tensor)
                or tuple(out.shape) != item.shape
                or out.dtype != item.dtype
                or out.device != self._device
            ):
                got = (
                    f"{tuple(out.shape)} {out.dtype} on {out.device}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise InvalidArgumentError(
                    f"the encoder returned {got} for {item.key!r}, but the item is {item.shape} "
                    f"{item.dtype} on {self._device}: fix the items or the encoder (the pipeline "
                    "never converts)"
                )
        return {item.key: out for item, out in zip(items, outputs, strict=True)}

    @staticmethod
    def _assemble(
        plan: Plan, mask: list[bool], answer: torch.Tensor, fresh: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``answer`` with each masked item's fresh output copied into its rows (as bytes
        where that is all ``copy_`` would do: a plain contiguous CPU output into a CPU answer)."""
        at = plan.offsets
        rows = _Rows(answer) if answer.is_cpu else None
        for n, (item, masked) in enumerate(zip(plan.items, mask, strict=True)):
            if masked:
                out = fresh[item.key]
                if rows is not None and bytes_only(out, item):
                    copy_bytes(rows.address(at[n]), out.data_ptr(), out.nbytes)
                else:
                    copy_rows(answer[at[n] : at[n + 1]], out)
        return answer

    # ------------------------------------------------------------------ collectives
    def _share_failure(self) -> None:
        """Tell the group this rank failed before the mask; never raises (the cause wins)."""
        if self._channel is not None:
            self._channel.share_failure()

    def _send(self, plan: Plan, local: _Local) -> None:
        """Rank 0: agree on the items, then broadcast the mask and the held rows."""
        if self._channel is not None:
            self._channel.send(plan, local.mask, local.answer)

    def _agree_encoded(self, *, failed: bool) -> None:
        """All-reduce whether the encoder failed anywhere; raise if another rank's did."""
        if self._channel is not None:
            self._channel.agree_encoded(failed=failed)

    # ------------------------------------------------------------------ counters
    def _count(self, **counts: int) -> None:
        with self._stats_lock:
            self._counts.update(counts)

    def _count_wait(self, seconds: float) -> None:
        with self._stats_lock:
            self._wait_seconds += seconds

    def _count_call(self, plan: Plan, local: _Local, encoded: int) -> None:
        local_hits = waited = 0
        reasons: list[str] = []
        for status, masked, reason in zip(local.statuses, local.mask, local.reasons, strict=True):
            if masked:  # the cache gives every item it does not serve a reason
                reasons.append("reason:" + ("unexplained" if reason is None else reason.value))
            elif status.status is Status.HIT:
                local_hits += 1
            else:
                waited += 1
        with self._stats_lock:  # (item by item: ``Counter.update`` with keywords is slower)
            c = self._counts
            c["calls"] += 1
            c["items"] += len(plan.items)
            c["local_hits"] += local_hits
            c["waited"] += waited
            c["fallback_items"] += len(reasons)
            c["encoded"] += encoded
            c["encoder_calls"] += encoded > 0
            for reason_key in reasons:
                c[reason_key] += 1


def _shares(seconds: float, tensors: list[torch.Tensor]) -> list[float]:
    """Each output's share of one encoder call's ``seconds``, by rows (equal shares if none)."""
    rows = [t.shape[0] if t.dim() else 1 for t in tensors]
    total = sum(rows)
    if not total:
        return [seconds / len(rows)] * len(rows)
    return [seconds * n / total for n in rows]


class _Rows:
    """Addresses of a contiguous host tensor's rows along dim 0."""

    def __init__(self, answer: torch.Tensor) -> None:
        self._base = answer.data_ptr()
        self._row = answer.nbytes // answer.shape[0] if answer.shape[0] else 0

    def address(self, row: int) -> int:
        """Where row ``row`` starts."""
        return self._base + row * self._row

    def nbytes(self, start: int, stop: int) -> int:
        """The bytes of rows ``start:stop``."""
        return (stop - start) * self._row


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a finite number of seconds > 0, got {value}")


async def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a worker thread; a cancellation is deferred until ``fn`` has returned."""
    future = asyncio.ensure_future(asyncio.to_thread(fn))
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result
