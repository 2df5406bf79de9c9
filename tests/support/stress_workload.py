"""The random multi-threaded request workload of the stress tests (``tests/stress/``) and the
stress soak (``benchmarks/soak/stress.py``).

``Workload`` runs ``threads`` request threads against one ``EmbeddingCache`` for a bounded
time, while a monitor thread calls ``check_invariants()`` and a chaos thread (given by the
caller) makes the store misbehave. Each request thread has its own seeded RNG and picks, at
random: lookups (with or without prefetch and reservation) of one to four items, waits with
short timeouts, inserts of its reservations and of fresh keys (published or not), leaving a
reservation unfilled, leaving by an exception, removes (also of keys it holds), ``clear`` and
``fence``.

Every payload is derived from a checksum of its key (and shape and dtype, so an entry served
under the wrong shape cannot pass): its first four bytes are that checksum. Every view a
request is served is compared with it when served and again just before the request ends, so
a pinned range that was freed, reused or overwritten is caught. Each key has two items of
different byte sizes (int32 and int16), so lookups also see MISMATCH and store loads of the
other size fail as short or too-small reads.

``finish`` (after the threads stop and the store is healthy again) waits for the transfers in
flight, fences, and checks the end state: no pins, no LOADING or QUARANTINED entry, nothing
doomed or tainted, exact accounting, and every entry and store object holds its key's bytes.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from embcache import EmbeddingCache, Item, Request, Status
from embcache.core.lifecycle import READY
from tests.support.helpers import raw

WAIT_S = 10.0
WAIT_TIMEOUTS = (0.0, 0.0005, 0.002, 0.01)


def checksum(item: Item) -> int:
    """The checksum every payload of ``item`` starts with."""
    return zlib.crc32(f"{item.key}|{item.shape}|{item.dtype}".encode())


def make_payload(item: Item) -> torch.Tensor:
    """``item``'s bytes: word ``i`` is ``checksum + i * 2654435761`` (mod 2**32)."""
    words = np.arange(item.nbytes // 4, dtype=np.uint32) * np.uint32(2654435761)
    words += np.uint32(checksum(item))
    return torch.from_numpy(words.view(np.uint8).copy()).view(item.dtype).view(item.shape)


def stress_seed() -> int:
    """The run's seed: ``EMBCACHE_STRESS_SEED`` (to replay a run), else a fresh random one."""
    given = os.environ.get("EMBCACHE_STRESS_SEED")
    return int(given) if given else random.SystemRandom().randrange(1, 2**31)


class Abandon(Exception):
    """Raised inside a request to leave it by an exception."""


@dataclasses.dataclass
class Mix:
    """Probabilities of the workload's choices."""

    clear: float = 0.01
    fence: float = 0.02
    remove: float = 0.08
    prefetch: float = 0.7
    reserve: float = 0.5
    fill_reservation: float = 0.85
    fresh_insert: float = 0.3
    publish: float = 0.5
    remove_held: float = 0.05
    abandon: float = 0.04
    variant: float = 0.15


@dataclasses.dataclass
class Report:
    """What a run did: counts for the throughput line and the sanity checks."""

    seconds: float
    operations: int
    requests: int
    views_checked: int
    invariant_checks: int
    stats: Any

    def line(self, name: str) -> str:
        s = self.stats
        return (
            f"{name}: {self.operations} operations ({self.requests} requests) in "
            f"{self.seconds:.2f} s = {self.operations / self.seconds:.0f} ops/s; "
            f"{self.views_checked} views checked, {self.invariant_checks} invariant checks; "
            f"hits {s.hits}, loads ok/failed/unknown {s.loads_ok}/{s.loads_failed}/"
            f"{s.loads_unknown}, inserts {s.inserts}, publishes ok/failed/unknown "
            f"{s.publishes_ok}/{s.publishes_failed}/{s.publishes_unknown}, evictions "
            f"{s.evictions}, fences {s.fences}, misses {s.misses_by_reason}"
        )


class Workload:
    """Random requests from ``threads`` threads against ``cache`` (see the module docstring)."""

    def __init__(
        self,
        cache: EmbeddingCache,
        *,
        seed: int,
        threads: int = 8,
        keys: int = 24,
        unit: int = 1024,
        mix: Mix | None = None,
    ) -> None:
        self.cache = cache
        self.seed = seed
        self.threads = threads
        self.mix = mix or Mix()
        self.keys = [f"img-{i:02d}" for i in range(keys)]
        self.canonical: dict[str, Item] = {}
        self.variant: dict[str, Item] = {}
        for i, key in enumerate(self.keys):
            units = 1 + i % 3
            self.canonical[key] = Item(key, (units * unit // 4,), torch.int32)
            self.variant[key] = Item(key, (units * unit // 2 + 128,), torch.int16)
        self.payloads = {
            item: make_payload(item) for item in [*self.canonical.values(), *self.variant.values()]
        }
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._count_lock = threading.Lock()
        self._operations = 0
        self._requests = 0
        self._views = 0
        self._checks = 0

    # ------------------------------------------------------------------ public
    def where(self) -> str:
        return f"seed {self.seed}: rerun with EMBCACHE_STRESS_SEED={self.seed}"

    def counts(self) -> tuple[int, int, int, int]:
        """So far: (operations, requests, views checked, invariant checks)."""
        with self._count_lock:
            return self._operations, self._requests, self._views, self._checks

    def item(self, key: str, rng: random.Random) -> Item:
        return self.variant[key] if rng.random() < self.mix.variant else self.canonical[key]

    def run(
        self, seconds: float, chaos: Callable[[random.Random, threading.Event], None]
    ) -> Report:
        """Run the request threads, the monitor and ``chaos`` for ``seconds``; join them all."""
        threads = [
            threading.Thread(target=self._guard, args=(f"requests-{i}", self._requests_loop, i))
            for i in range(self.threads)
        ]
        threads.append(threading.Thread(target=self._guard, args=("monitor", self._monitor, 0)))
        chaos_stop = threading.Event()
        chaos_rng = random.Random(self.seed - 1)
        chaos_thread = threading.Thread(
            target=self._guard, args=("chaos", lambda _: chaos(chaos_rng, chaos_stop), 0)
        )
        started = time.monotonic()
        for thread in [*threads, chaos_thread]:
            thread.start()
        self.stop.wait(seconds)
        self.stop.set()
        for thread in threads:
            thread.join(60)
        elapsed = time.monotonic() - started
        chaos_stop.set()
        chaos_thread.join(60)
        hung = [t.name for t in [*threads, chaos_thread] if t.is_alive()]
        assert not hung, f"threads still running (deadlock?) {hung}; {self.where()}"
        return Report(
            seconds=elapsed,
            operations=self._operations,
            requests=self._requests,
            views_checked=self._views,
            invariant_checks=self._checks,
            stats=self.cache.stats(),
        )

    def assert_no_errors(self) -> None:
        assert not self.errors, f"{len(self.errors)} thread(s) failed; {self.where()}:\n" + (
            "\n".join(self.errors[:3])
        )

    def finish(self) -> None:
        """After the run: drain transfers, fence, and check the end state (module docstring)."""
        self.drain()
        self.cache.fence()
        self.check_end_state()

    def drain(self) -> None:
        """Wait until no transfer is in flight, nothing is pinned and the publish backlog is
        empty. (The store is healthy again: the backlog's background retries publish what
        failed during the outage, each pinning its entry while it runs; one started after a
        check of pins alone was seen pinned by ``check_end_state``.) Three times ``WAIT_S``:
        after a master restart the backlog took 10.9 s to drain once (CI, a loaded machine),
        its probe running once a second while the client reconnects."""
        deadline = time.monotonic() + 3 * WAIT_S
        while True:
            stats = self.cache.stats()
            publishing = stats.publishes_started - (
                stats.publishes_ok + stats.publishes_failed + stats.publishes_unknown
            )
            if not (
                stats.entries_by_state.get("LOADING")
                or stats.pinned_entries
                or stats.publish_backlog
                or publishing
            ):
                return
            assert time.monotonic() < deadline, f"transfers never ended: {stats}; {self.where()}"
            time.sleep(0.005)

    def check_end_state(self) -> None:
        """Nothing open, pinned, loading, quarantined, doomed or leaked (module docstring)."""
        cache = self.cache
        cache.check_invariants()
        stats = cache.stats()
        where = self.where()
        assert stats.open_requests == 0, f"{stats}; {where}"
        assert stats.pinned_entries == 0 and stats.pinned_bytes == 0, f"{stats}; {where}"
        assert set(stats.entries_by_state) <= {"READY"}, f"{stats}; {where}"
        assert stats.allocated_bytes == sum(stats.bytes_by_state.values()), f"{stats}; {where}"
        assert stats.allocated_bytes + stats.free_bytes == stats.capacity_bytes, f"{stats}; {where}"
        leftovers = [  # the entries themselves: nothing doomed or tainted is left behind
            (e.key, e.state.name, e.doomed, e.tainted, e.publishing)
            for e in cache.snapshot().entries.values()
            if e.doomed or e.tainted or e.publishing or e.state is not READY
        ]
        assert not leftovers, f"entries left busy: {leftovers}; {where}"
        self._check_every_entry()
        self._check_store_objects()
        assert cache.clear() == stats.entries
        assert cache.stats().allocated_bytes == 0, f"bytes leaked: {cache.stats()}; {where}"
        cache.check_invariants()

    # ------------------------------------------------------------------ threads
    def _guard(self, name: str, body: Callable[[int], None], index: int) -> None:
        threading.current_thread().name = name
        try:
            body(index)
        except BaseException:
            self.errors.append(f"[{name}] {traceback.format_exc()}")
            self.stop.set()

    def _count(self, operations: int = 0, requests: int = 0, views: int = 0) -> None:
        with self._count_lock:
            self._operations += operations
            self._requests += requests
            self._views += views

    def _monitor(self, _: int) -> None:
        while not self.stop.is_set():
            self.cache.check_invariants()
            self._checks += 1
            time.sleep(0.002)

    def _requests_loop(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        mix = self.mix
        n = 0
        while not self.stop.is_set():
            n += 1
            choice = rng.random()
            if choice < mix.clear:
                self.cache.clear()
            elif choice < mix.clear + mix.fence:
                self.cache.fence()
            elif choice < mix.clear + mix.fence + mix.remove:
                self.cache.remove(rng.choice(self.keys))
            else:
                try:
                    with self.cache.request(f"r{index}-{n}") as request:
                        self._request(rng, request)
                except Abandon:
                    pass
                self._count(requests=1)
            self._count(operations=1)

    # ------------------------------------------------------------------ one request
    def _request(self, rng: random.Random, request: Request) -> None:
        mix = self.mix
        looked_up: list[Item] = []
        served: list[tuple[Item, torch.Tensor]] = []
        unfilled: dict[str, Item] = {}  # this request's reservations (insert their own shape)
        for _ in range(rng.randint(1, 3)):
            items = [self.item(rng.choice(self.keys), rng) for _ in range(rng.randint(1, 4))]
            statuses = request.lookup(
                items,
                prefetch=rng.random() < mix.prefetch,
                reserve_misses=rng.random() < mix.reserve,
            )
            assert len(statuses) == len(items)
            looked_up += items
            if any(s.status is Status.LOADING for s in statuses):
                request.wait(rng.choice(WAIT_TIMEOUTS))
                self._count(operations=1)
            served += self._check_views(request, looked_up)
            for it, s in zip(items, statuses, strict=True):
                if s.status is Status.RESERVED:
                    unfilled[it.key] = it
            fill = [it for it in unfilled.values() if rng.random() < mix.fill_reservation]
            if fill:
                inserted = request.insert(
                    [it.key for it in fill],
                    [self.payloads[it] for it in fill],
                    publish=rng.random() < mix.publish,
                )
                assert len(inserted) == len(fill)
                for it in fill:
                    del unfilled[it.key]
                self._count(operations=1)
                served += self._check_views(request, looked_up)
            if rng.random() < mix.fresh_insert:
                key = rng.choice(self.keys)
                fresh = unfilled.pop(key, None) or self.item(key, rng)
                request.insert(
                    [fresh.key], [self.payloads[fresh]], publish=rng.random() < mix.publish
                )
                self._count(operations=1)
            if rng.random() < mix.remove_held:
                self.cache.remove(rng.choice(looked_up).key)
                self._count(operations=1)
            if rng.random() < mix.abandon:
                self._recheck(served)
                raise Abandon
        self._recheck(served)

    def _check_views(
        self, request: Request, looked_up: list[Item]
    ) -> list[tuple[Item, torch.Tensor]]:
        """Every served view has its item's shape, dtype and bytes; with nothing pending, the
        fallback mask is exactly the items not served."""
        settled = request.wait(0.0)
        views = request.embeddings()
        self._count(operations=2)
        assert len(views) == len(looked_up)
        served = []
        for item, view in zip(looked_up, views, strict=True):
            if view is None:
                continue
            assert view.dtype == item.dtype and tuple(view.shape) == item.shape, (item, view.shape)
            self._check_bytes(item, view)
            served.append((item, view))
        if settled:
            mask = request.fallback_mask().tolist()
            assert mask == [int(v is None) for v in views], (looked_up, mask)
        self._count(views=len(served))
        return served

    def _recheck(self, served: list[tuple[Item, torch.Tensor]]) -> None:
        """Views held to the end of the request still hold their bytes (no reuse under a pin)."""
        for item, view in served:
            self._check_bytes(item, view)
        self._count(views=len(served))

    def _check_bytes(self, item: Item, view: torch.Tensor) -> None:
        head = int(view.reshape(-1).view(torch.uint8)[:4].view(torch.int32).item()) & 0xFFFFFFFF
        assert head == checksum(item), f"{item.key}: checksum {head:#x} != {checksum(item):#x}"
        assert torch.equal(view, self.payloads[item]), f"{item.key}: payload bytes differ"

    # ------------------------------------------------------------------ end state
    def _check_every_entry(self) -> None:
        """Every entry still present serves its key's bytes under one of its two items."""
        for key in self.keys:
            if self.cache.entry_state(key) is not READY:
                continue
            with self.cache.request(f"final-{key}") as request:
                request.lookup([self.canonical[key], self.variant[key]], prefetch=False)
                views = [v for v in request.embeddings() if v is not None]
                assert len(views) == 1, f"{key}: served {len(views)} views; {self.where()}"
                item = self.canonical[key] if views[0].dtype == torch.int32 else self.variant[key]
                self._check_bytes(item, views[0])

    def _check_store_objects(self) -> None:
        """Whatever a publish left in an in-process store is one of its key's payloads."""
        read = getattr(self.cache.store, "object", None)
        if read is None:
            return
        for key in self.keys:
            stored = read(key)
            if stored is not None:
                allowed = {
                    raw(self.payloads[self.canonical[key]]),
                    raw(self.payloads[self.variant[key]]),
                }
                assert stored in allowed, f"store object {key} is corrupt; {self.where()}"
