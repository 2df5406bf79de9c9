"""Who holds which pin for the SGLang controller: SGLang's per-hash pins over embcache requests.

SGLang's controller counts pins per hash (``get_pool_views`` +1, ``release_pool_views`` -1),
and after ``prefetch`` its calls carry no request id. embcache pins belong to requests. This
module maps the one onto the other:

- A *prefetch* is one embcache ``Request`` that looked its hashes up. Once its loads have
  ended (``finish``), each hash it serves becomes a *ticket*: a pin waiting for its reader.
- ``has_local_embedding`` answers for the caller's own prefetch: the last one started in the
  same thread or asyncio task (a context variable), True only while that prefetch still keeps
  the hash. Answering from any request's ticket let a caller whose own prefetch missed a hash
  see another request's ticket, which that request could take and release before the caller
  read: the read then found nothing (seen about once in a hundred runs of 4 MMEncoder threads).
  A reader takes its own prefetch's ticket first, so no request's ticket is used up by
  another's read. A caller with no prefetch in its context (a prefetch made in another
  thread) gets the old answer, any ticket or reader of the hash, and takes the oldest ticket.
- A reader (``get_pool_views``, ``load_to_device_async``, ``get_embeddings``) takes a ticket
  of the hash if there is one, else joins the readers already holding the hash (SGLang's
  count above one); with neither it gets nothing (SGLang: the entry is not READY).
- A release (``release_pool_views``, ``wait_load_to_device``, ``release_embeddings``) ends one
  reader of the hash; when the last reader goes, every prefetch that backed the hash gives it
  up. A release that finds no reader consumes a ticket (MMEncoder releases in a ``finally``,
  also when its read failed).
- A prefetch that gave up every hash it served is closed: its embcache pins are released.
  They are released together (a ``Request`` releases its pins when it closes): a hash given up
  early stays pinned until the prefetch's last one is. MMEncoder gives up every hash of a
  request in one call (``release_pool_views``, ``wait_load_to_device``), so it sees no
  difference from SGLang's per-hash counts.
- A *staged store* (``store_to_pool_async``) holds its reservations until it is claimed by
  ``wait_store_to_pool``.
- A prefetch or staged store still open ``hold_timeout_s`` after it started is expired by the
  next ``expire`` call: a staged store is closed (its reservations end, their waiters fall
  back), a prefetch drops its tickets and is closed once no reader depends on it. Only a
  reader keeps a pin for as long as it likes, as in SGLang.

Pure bookkeeping under one lock, never held while calling the cache: each method returns the
requests its caller must close, after the lock is released. Each method is O(hashes it is
given); ``expire`` is O(what it expires).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from embcache.driver.item import Item
from embcache.driver.request import Request


@dataclass(eq=False, slots=True)
class Prefetch:
    """One ``prefetch`` call: its request, its items, and the hashes it still holds for SGLang."""

    request: Request
    req_id: str
    items: list[Item]
    serves: dict[str, int] = field(default_factory=dict)  # hash -> index in items, once finished
    kept: set[str] = field(default_factory=set)  # served hashes not given up yet
    finished: bool = False
    closed: bool = False
    views: list[torch.Tensor | None] | None = None  # read by device copies only, never handed out


@dataclass(eq=False)
class Staged:
    """One ``store_to_pool_async`` call: the reserved keys and their staged tensors."""

    request: Request
    keys: list[str]
    tensors: list[torch.Tensor]
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event per device copied from
    sources: list[torch.Tensor] = field(default_factory=list)  # CUDA inputs kept alive
    claimed: bool = False


_mine: ContextVar[Prefetch | None] = ContextVar("embcache_sglang_prefetch", default=None)


def _take_ticket(tickets: list[Prefetch], mine: Prefetch | None) -> Prefetch:
    """The caller's own ticket (``mine``: its context's prefetch) if it has one in
    ``tickets``, else the oldest: a caller that took another request's ticket would leave its
    own behind, and that request's pin could end before its own reader came. (Callers take
    the only ticket of a hash themselves: the caller's or the oldest alike.)"""
    if mine is not None and mine in tickets:
        tickets.remove(mine)
        return mine
    return tickets.pop(0)


def forget_mine() -> None:
    """The caller's context has no prefetch (one that was refused before it started)."""
    _mine.set(None)


class Holds:
    """The per-hash pin accounting of one controller (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Prefetch] = {}  # req_id -> prefetch whose loads may run
        self._tickets: dict[str, list[Prefetch]] = {}  # oldest first; rarely more than one
        self._readers: dict[str, int] = {}  # hash -> how many reads are open
        self._backing: dict[str, list[Prefetch]] = {}  # hash -> the prefetches those pin it
        self._live: OrderedDict[Prefetch | Staged, float] = OrderedDict()  # -> deadline
        # At most every deadline in _live: lowered as one is added, recomputed by expire
        # (a hold that ends otherwise only raises the true minimum). Read without the lock
        # (a float read is atomic): ``expire`` has nothing to do before it.
        self.earliest = float("inf")

    def start(
        self, prefetch: Prefetch, deadline: float, served: Sequence[bool] | None = None
    ) -> list[Request]:
        """Register a new prefetch; an unfinished one with the same req_id is closed. With
        ``served`` (no load to wait for), ``finish`` it too, under the same hold of the lock."""
        _mine.set(prefetch)
        with self._lock:
            old = self._running.pop(prefetch.req_id, None)
            self._running[prefetch.req_id] = prefetch
            self._live[prefetch] = deadline
            self.earliest = min(self.earliest, deadline)
            closing = [] if old is None else self._close(old)
            if served is not None:
                closing += self._finish(prefetch, served)
            return closing

    def sizes(self) -> dict[str, int]:
        """How many entries each container holds now (the memory bounds: all empty once
        every prefetch is read or expired and every staged store claimed). O(1)."""
        with self._lock:
            return {
                "running": len(self._running),
                "tickets": len(self._tickets),
                "readers": len(self._readers),
                "backing": len(self._backing),
                "live": len(self._live),
            }

    def running(self, req_id: str) -> Prefetch | None:
        """The unfinished prefetch of ``req_id``, if any."""
        with self._lock:
            return self._running.get(req_id)

    def finish(self, prefetch: Prefetch, served: Sequence[bool]) -> list[Request]:
        """End ``prefetch``'s loads: ``served[i]`` is True where item i is pinned for it."""
        with self._lock:
            return self._finish(prefetch, served)

    def _finish(self, prefetch: Prefetch, served: Sequence[bool]) -> list[Request]:
        if prefetch.closed or prefetch.finished:
            return []
        prefetch.finished = True
        self._running.pop(prefetch.req_id, None)
        items = prefetch.items
        assert len(items) == len(served), "one outcome per item"
        # Each served hash and the index of its first occurrence (the reversed walk leaves
        # the smallest index last).
        serves = prefetch.serves = {
            items[i].key: i for i in range(len(items) - 1, -1, -1) if served[i]
        }
        tickets = self._tickets
        for key in serves:
            tickets.setdefault(key, []).append(prefetch)
        prefetch.kept.update(serves)
        return [] if serves else self._close(prefetch)

    def has(self, key: str) -> bool:
        """Whether the caller's own prefetch (module docstring) finished and still keeps
        ``key``: its pin stays until the caller gives the hash back, so the read that follows
        finds it. Without a prefetch in the caller's context: whether any finished prefetch or
        reader holds ``key``. O(1), lock-free (set and dict lookups, atomic under the GIL)."""
        mine = _mine.get()
        if mine is not None:
            return mine.finished and not mine.closed and key in mine.kept
        return key in self._tickets or key in self._readers

    def take(self, keys: Iterable[str]) -> list[tuple[Prefetch, int] | None]:
        """Make each key's caller a reader: the prefetch that pins it and the item index."""
        taken: list[tuple[Prefetch, int] | None] = []
        readers, backing, all_tickets = self._readers, self._backing, self._tickets
        mine = _mine.get()
        with self._lock:
            for key in keys:
                tickets = all_tickets.get(key)
                if tickets:
                    if len(tickets) > 1:
                        prefetch = _take_ticket(tickets, mine)
                    else:
                        prefetch = tickets[0]
                        del all_tickets[key]
                    count = readers.get(key)
                    if count is None:  # the first reader: its ticket's prefetch backs it
                        readers[key] = 1
                        backing[key] = [prefetch]
                        taken.append((prefetch, prefetch.serves[key]))
                        continue
                    readers[key] = count + 1
                    backing[key].append(prefetch)
                elif key in readers:
                    readers[key] += 1
                else:
                    taken.append(None)
                    continue
                prefetch = backing[key][0]
                taken.append((prefetch, prefetch.serves[key]))
        return taken

    def give_back(self, keys: Iterable[str]) -> list[Request]:
        """End one reader of each key (or consume a ticket where no reader is left)."""
        closing: list[Request] = []
        readers, backing, all_tickets = self._readers, self._backing, self._tickets
        mine = _mine.get()
        with self._lock:
            for key in keys:
                count = readers.get(key)
                if count is not None:
                    if count > 1:
                        readers[key] = count - 1
                        continue
                    del readers[key]
                    for prefetch in backing.pop(key):
                        kept = prefetch.kept  # (``_drop`` inlined: once per hash read)
                        kept.discard(key)
                        if not kept:
                            closing += self._close(prefetch)
                elif tickets := all_tickets.get(key):
                    if len(tickets) > 1:
                        prefetch = _take_ticket(tickets, mine)
                    else:
                        prefetch = tickets[0]
                        del all_tickets[key]
                    closing += self._drop(prefetch, key)
        return closing

    def add_staged(self, staged: Staged, deadline: float) -> None:
        """Register a staged store until ``claim`` or expiry."""
        with self._lock:
            self._live[staged] = deadline
            self.earliest = min(self.earliest, deadline)

    def claim(self, staged: Staged) -> bool:
        """Take ``staged`` for its wait; False if it was claimed or expired already."""
        with self._lock:
            if staged.claimed:
                return False
            staged.claimed = True
            self._live.pop(staged, None)
            return True

    def expire(self, now: float) -> list[Request]:
        """Expire what started before its deadline (module docstring); the requests to close.
        Before the earliest deadline it returns at once, without the lock."""
        closing: list[Request] = []
        if now < self.earliest:  # a float read: atomic; a lower bound of every deadline
            return closing
        with self._lock:
            while self._live:
                held, deadline = next(iter(self._live.items()))
                if deadline > now:
                    break
                del self._live[held]
                if isinstance(held, Staged):
                    held.claimed = True
                    closing.append(held.request)
                elif not held.finished:
                    if self._running.get(held.req_id) is held:
                        del self._running[held.req_id]
                    closing += self._close(held)
                else:
                    for key in list(held.kept):
                        tickets = self._tickets.get(key)
                        if tickets is None or held not in tickets:
                            continue  # it backs a reader of key: kept until that reader ends
                        tickets.remove(held)
                        if not tickets:
                            del self._tickets[key]
                        closing += self._drop(held, key)
            self.earliest = next(iter(self._live.values()), float("inf"))
        return closing

    def _drop(self, prefetch: Prefetch, key: str) -> list[Request]:
        prefetch.kept.discard(key)
        return [] if prefetch.kept else self._close(prefetch)

    def _close(self, prefetch: Prefetch) -> list[Request]:
        if prefetch.closed:
            return []
        prefetch.closed = True
        self._live.pop(prefetch, None)
        return [prefetch.request]
