"""``StepRunner``: the one place that runs a core step and carries out its ``Effects``.

Theory of operation (embcache/DESIGN.md, "One funnel per step"). The runner holds the cache
lock, the core (``embcache.core.cache_core.CacheCore``), the pool and its views, the store, the
wake-ups of waiting requests and the I/O pool. ``run(step, ...)`` takes the lock, calls one core
step (which checks that the cache and the request are open, raising ``ClosedError``), poisons the
ranges it freed (debug mode: before the lock goes, so no allocation can take them first) and
arms, drops or fires wake-ups (they live under the lock, so an Event is set only while the core
says nothing is pending); then, with no lock held, it hands the trace events to the sink,
resolves asyncio waiters, and submits the step's store reads and writes to the I/O pool, whose
workers (``run_loads``, ``run_publishes``) report back through the ``end_loads`` and
``end_publishes`` steps. Nothing slow happens under the lock. ``run`` is typed with a
``ParamSpec``: a step's flags are keywords, and mypy checks every argument.

``EmbeddingCache`` (configuration and lifecycle) and every ``Request`` hold one runner and use
only its public names: ``run``, ``core``, ``store``, ``views``, ``wait``, ``wait_async``,
``lock`` (the cache lock, for a read-only query of ``core.queries``) and ``wakeups``.

Wake-ups: a request gets a ``Wakeup`` (an Event and asyncio futures) when it first waits on a
load and loses it when it closes; it is kept by the request's own record, so a later request
that reuses the id is never woken by it. Lock hierarchy: the cache lock is level 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar

import torch

from embcache.core.cache_core import CacheCore
from embcache.core.effects import Effects, Writes
from embcache.core.entries import Entry, RequestState
from embcache.core.outcomes import TransferOutcome
from embcache.driver.global_store import GlobalStore, get_outcome, put_outcome
from embcache.driver.locks import CHECKING, HierarchyLock, assert_unlocked
from embcache.driver.poison import poison
from embcache.driver.pool import PoolViews, payload_nbytes
from embcache.driver.trace import TraceOutbox
from embcache.errors import ClosedError, LockOrderError

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")  # a step's parameters: mypy checks each argument, keywords included
Future = tuple[asyncio.AbstractEventLoop, "asyncio.Future[bool]"]
Published = Callable[[list[Entry], list[TransferOutcome]], None]


class IOExecutor(Protocol):
    """What runs the cache's store reads and writes (``concurrent.futures.Executor`` is one):
    ``submit(fn, *args)`` runs ``fn(*args)`` later, on any thread but the caller's lock-free;
    ``shutdown(wait=True)`` returns once every task submitted has run."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> object: ...
    def shutdown(self, wait: bool = True) -> object: ...


@dataclass(eq=False, slots=True)
class Wakeup:
    """How one request is woken: an Event (set while nothing is pending) and asyncio futures."""

    event: threading.Event
    futures: list[Future] = field(default_factory=list)


class Wakeups(dict[RequestState, Wakeup]):
    """The ``Wakeup`` of each open request that ever waited, by request (by identity:
    ``RequestState`` has ``eq=False``); ``get(rs)`` is None for one that never waited, and the
    dict is empty while no open request ever waited. Every method: cache lock held."""

    def futures_count(self) -> int:
        """How many asyncio futures wait to be resolved, over every request. O(n)."""
        return sum(len(w.futures) for w in self.values())

    def note(self, rs: RequestState, new_event: Callable[[], threading.Event]) -> None:
        """After a lookup: clear rs's Event while it waits on a load, set it otherwise (only
        requests that ever wait get one)."""
        wakeup = self.get(rs)
        if rs.pending():
            if wakeup is None:
                wakeup = self[rs] = Wakeup(new_event())
            wakeup.event.clear()
        elif wakeup is not None:
            wakeup.event.set()

    def wake(self, requests: Iterable[RequestState]) -> list[Future]:
        """Set the Event of each request with nothing pending; their futures, to resolve."""
        futures: list[Future] = []
        for rs in requests:
            wakeup = self.get(rs)
            if wakeup is not None and not rs.pending():
                wakeup.event.set()
                futures += wakeup.futures
                wakeup.futures = []
        return futures

    def close(self, rs: RequestState) -> list[Future]:
        """``rs`` closed: set its Event (someone may wait on it) and forget it; its futures,
        to resolve."""
        wakeup = self.pop(rs, None)
        if wakeup is None:
            return []
        wakeup.event.set()
        return wakeup.futures


def resolve(futures: list[Future]) -> None:
    """Resolve waiting asyncio futures on their loops. Called with no lock held."""
    assert_unlocked("waking asyncio tasks")
    for loop, future in futures:
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(True)


class StepRunner:
    """Runs core steps under the cache lock and carries out their effects (module docstring).

    ``published``, when given, is told each batch of publishes that ended and their outcomes,
    with no lock held (the publish backlog: ``embcache.driver.backlog``)."""

    def __init__(
        self, core: CacheCore, pool: torch.Tensor, *, store: GlobalStore | None,
        lock: HierarchyLock | threading.Lock, io: IOExecutor,
        new_event: Callable[[], threading.Event], outbox: TraceOutbox | None,
        published: Published | None = None,
    ) -> None:  # fmt: skip
        self.core = core
        self.pool = pool
        self.store = store  # None: no global tier
        self.views = PoolViews(pool)
        self.lock = lock
        self.wakeups = Wakeups()
        self.io = io
        self._new_event = new_event
        self._outbox = outbox
        self._published = published

    def run(self, step: Callable[P, Effects[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``step(*args, **kwargs)`` under the cache lock, then carry out its ``Effects``
        (module docstring); the step's result."""
        with self.lock:
            fx = step(*args, **kwargs)
            if not (self.wakeups or fx.busy()):  # nothing to carry out (an idle hit's steps)
                return fx.result
            if fx.freed:
                poison(self.pool, fx.freed)
            futures: list[Future] | None = None
            wakeups, waiting = self.wakeups, fx.waiting
            # (no wake-up to note while none exists and the request waits on nothing)
            if waiting is not None and (wakeups or (waiting.waits and waiting.pending())):
                wakeups.note(waiting, self._new_event)
            if fx.wake:
                futures = wakeups.wake(fx.wake)
            if fx.closed is not None and wakeups:  # someone may wait on the closed request
                own = wakeups.close(fx.closed)
                futures = own if futures is None else futures + own
        if fx.events:
            assert self._outbox is not None
            self._outbox.deliver(list(fx.events))
        if fx.wake and CHECKING.on:  # a caller's lock must not span a hand-off
            assert_unlocked("waking requests")
        if futures:
            resolve(futures)
        if fx.loads or fx.writes is not None:
            self._hand_off(fx.loads, fx.writes)
        return fx.result

    def _hand_off(self, loads: Sequence[Entry], writes: Writes | None) -> None:
        """Submit a step's store reads and writes to the I/O pool. A pool that refuses one
        (shut down: a ``close()`` ran between the step and this hand-off) started nothing, so
        each refused transfer ends FAILED at once (its pins go, its waiters fall back, a write
        joins the backlog as any failed publish), and then the caller gets ``ClosedError``
        (the pool's RuntimeError, as ``Executor.submit``'s after shutdown) or the pool's own
        error."""
        refused: Exception | None = None
        if loads:
            entries = list(loads)
            try:
                self.io.submit(self.run_loads, entries)
            except Exception as exc:
                refused = exc
                self.run(self.core.end_loads, entries, [TransferOutcome.FAILED] * len(entries))
        if writes is not None:
            try:
                self.io.submit(self.run_publishes, *writes)
            except Exception as exc:
                refused = refused or exc
                failed = [TransferOutcome.FAILED] * len(writes.entries)
                self._end_publishes(writes.request_id, list(writes.entries), failed)
        if isinstance(refused, RuntimeError):
            raise ClosedError(
                "the cache closed while this step handed its store transfers over: none "
                "started (each ended FAILED)"
            ) from refused
        if refused is not None:
            raise refused

    def wait(self, rs: RequestState, seconds: float | None) -> bool:
        """Block until every load ``rs`` waits on has ended; False after ``seconds``."""
        assert_unlocked("request wait")
        wakeup = self.wakeups.get(rs)  # None: it never waited
        return wakeup is None or bool(wakeup.event.wait(seconds))

    async def wait_async(self, rs: RequestState, seconds: float | None) -> bool:
        """``wait`` for asyncio callers; does not block the event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        with self.lock:  # the wake-ups live under the cache lock
            wakeup = self.wakeups.get(rs)  # its Event is set while nothing is pending
            if wakeup is None or wakeup.event.is_set():
                return True
            (futures := wakeup.futures).append((loop, future))
        try:
            return await asyncio.wait_for(asyncio.shield(future), seconds)
        except TimeoutError:
            with self.lock:
                if (loop, future) in futures:
                    futures.remove((loop, future))
            return False

    def trace_batches(self) -> int:
        """Trace batches handed in and not yet delivered (0 when not tracing). O(1)."""
        return 0 if self._outbox is None else self._outbox.waiting_batches()

    # ------------------------------------------------------------------ I/O (no lock held)
    def run_loads(self, entries: list[Entry]) -> None:
        """I/O worker: read every entry from the store, then end each load and wake its
        waiters, whatever is raised on the way (an error leaves each outcome UNKNOWN, then
        re-raises unless it is the store's own)."""
        store = self.store
        assert store is not None  # a load starts only from a store's answer
        sizes = [payload_nbytes(e) for e in entries]
        outcomes = [TransferOutcome.UNKNOWN] * len(entries)  # until the store says otherwise
        try:
            assert_unlocked("store get_into")
            codes = store.get_into([e.key for e in entries], [e.offset for e in entries], sizes)
            outcomes = [get_outcome(store, c, n) for c, n in zip(codes, sizes, strict=True)]
        except LockOrderError:
            log.error("store read on an I/O thread broke the lock order", exc_info=True)
            raise
        except Exception:
            pass  # the store failed: the reads may still land, so UNKNOWN
        finally:
            self.run(self.core.end_loads, entries, outcomes)

    def run_publishes(self, request_id: str, entries: list[Entry]) -> None:
        """I/O worker: write every entry to the store, then end each publish, come what may,
        and tell ``published`` how they ended."""
        store = self.store
        assert store is not None  # a publish starts only where there is a store
        outcomes = [TransferOutcome.UNKNOWN] * len(entries)
        try:
            assert_unlocked("store put_from")
            codes = store.put_from(
                [e.key for e in entries],
                [e.offset for e in entries],
                [payload_nbytes(e) for e in entries],
            )
            if len(codes) == len(entries):
                outcomes = [put_outcome(store, c) for c in codes]
        except LockOrderError:
            log.error("store write on an I/O thread broke the lock order", exc_info=True)
            raise
        except Exception:
            pass  # the store failed: the writes may still read the ranges, so UNKNOWN
        finally:
            self._end_publishes(request_id, entries, outcomes)

    def _end_publishes(
        self, request_id: str, entries: list[Entry], outcomes: list[TransferOutcome]
    ) -> None:
        """End each publish with its outcome and tell ``published`` (the backlog) of them."""
        self.run(self.core.end_publishes, request_id, entries, outcomes)
        if self._published is not None:
            self._published(entries, outcomes)
