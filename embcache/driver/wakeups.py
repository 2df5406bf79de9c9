"""How the driver wakes requests that wait on loads: per request record, an Event and futures.

A request gets a ``Wakeup`` when it first waits on a load, and loses it when it closes; it is
kept by the request's own record, so a later request that reuses the id is never woken by it. Every
method of ``Wakeups`` is called under the cache lock, so an Event is set only while the core says
nothing is pending (a late wake-up cannot end a newer wait); the futures a call hands back are
resolved by ``resolve`` after the lock is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from embcache.core.entries import RequestState
from embcache.driver.locks import assert_unlocked

Future = tuple[asyncio.AbstractEventLoop, "asyncio.Future[bool]"]


@dataclass(eq=False, slots=True)
class Wakeup:
    """How one request is woken: an Event (set while nothing is pending) and asyncio futures."""

    event: threading.Event
    futures: list[Future] = field(default_factory=list)


class Wakeups:
    """The ``Wakeup`` of each open request that ever waited (cache lock held)."""

    def __init__(self) -> None:
        self._by_rs: dict[RequestState, Wakeup] = {}  # by identity (RequestState has eq=False)

    def get(self, rs: RequestState) -> Wakeup | None:
        """``rs``'s Wakeup, None if it never waited."""
        return self._by_rs.get(rs)

    def futures(self, rs: RequestState) -> list[Future]:
        """The futures list of ``rs``, which waits (``note`` gave it a Wakeup): append to it."""
        return self._by_rs[rs].futures

    def __len__(self) -> int:
        """How many requests have a Wakeup (open ones that ever waited). O(1)."""
        return len(self._by_rs)

    def futures_count(self) -> int:
        """How many asyncio futures wait to be resolved, over every request. O(n)."""
        return sum(len(w.futures) for w in self._by_rs.values())

    def note(self, rs: RequestState, new_event: Callable[[], threading.Event]) -> None:
        """After a lookup: clear rs's Event while it waits on a load, set it otherwise (only
        requests that ever wait get one)."""
        wakeup = self._by_rs.get(rs)
        if rs.pending():
            if wakeup is None:
                wakeup = self._by_rs[rs] = Wakeup(new_event())
            wakeup.event.clear()
        elif wakeup is not None:
            wakeup.event.set()

    def wake(self, requests: Iterable[RequestState]) -> list[Future]:
        """Set the Event of each request with nothing pending; their futures, to resolve."""
        futures: list[Future] = []
        for rs in requests:
            wakeup = self._by_rs.get(rs)
            if wakeup is not None and not rs.pending():
                wakeup.event.set()
                futures += wakeup.futures
                wakeup.futures = []
        return futures

    def close(self, rs: RequestState) -> list[Future]:
        """``rs`` closed: set its Event (someone may wait on it) and forget it; its futures,
        to resolve."""
        wakeup = self._by_rs.pop(rs, None)
        if wakeup is None:
            return []
        wakeup.event.set()
        return wakeup.futures


def resolve(futures: list[Future]) -> None:
    """Resolve waiting asyncio futures on their loops. Called with no lock held."""
    if not futures:
        return
    assert_unlocked("waking asyncio tasks")
    for loop, future in futures:
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(True)
