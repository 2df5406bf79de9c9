"""Helpers shared by the tests: seeded payloads, stored bytes, unique names, bounded polling, a
cache on a real Mooncake master, a cache checked idle once its transfers ended, a fence on a
thread of its own, this process's resident memory, the evict-after-close harness, an I/O pool
that runs a task only when the test says (``ManualExecutor``)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, Item, ItemStatus, Request
from embcache.core.policy_tinylfu import TinyLfuPolicy
from embcache.store.mooncake import MooncakeStore
from embcache.store.mooncake_master import MooncakeMaster

CUDA = torch.cuda.is_available()
# A test's ``device`` parameter: "cpu" everywhere, "cuda" where torch sees a device (CI has none;
# ``bash .ci/cuda`` runs them on a machine that has one).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))]


class AdmitsNothing(TinyLfuPolicy):
    """A policy that admits no insert that must evict: a pool full once refuses every new key
    (``not_admitted``). Extends a policy compiled to allow interpreted subclasses."""

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        return False


class GatedEncoder:
    """Each key's embedding: ``shape`` rows of ``len(key)``, on ``device``; counts the keys it
    encodes. With ``gate`` set, a call says it ``entered`` and waits for the gate (10 s)."""

    def __init__(self, shape: tuple[int, ...], device: str = "cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.encoded: list[str] = []
        self.entered = threading.Event()
        self.gate: threading.Event | None = None

    def __call__(self, keys: Sequence[str], /) -> list[torch.Tensor]:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.encoded += keys
        return [torch.full(self.shape, float(len(k)), device=self.device) for k in keys]


def payload(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic, seed-dependent values (every byte pattern differs between seeds)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)


def raw(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor`` as stored (any dtype, bf16 included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def item_of(key: str, tensor: torch.Tensor) -> Item:
    """The item naming ``tensor`` under ``key``."""
    return Item(key, tuple(tensor.shape), tensor.dtype)


def aligned(nbytes: int, alignment: int = 256) -> int:
    """``nbytes`` rounded up to ``alignment``."""
    return -(-nbytes // alignment) * alignment


def unique(name: str) -> str:
    """``name`` made unique to this call (keys and request ids on a store other tests share)."""
    return f"{name}-{uuid.uuid4().hex[:10]}"


class ManualExecutor:
    """Stands in for a cache's I/O pool (``io_executor``): tasks wait in a queue until the test
    runs one, so a transfer stays in flight as long as the test wants. ``submit`` may be called
    from another thread (a republisher's)."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Any, tuple[Any, ...]]] = []

    def submit(self, fn: Any, *args: Any) -> None:
        self.tasks.append((fn, args))

    def run(self, index: int) -> None:
        """Run the ``index``-th waiting task (0: the oldest)."""
        fn, args = self.tasks.pop(index)
        fn(*args)

    def run_all(self) -> None:
        """Run every waiting task, oldest first (those they submit too)."""
        while self.tasks:
            self.run(0)

    def shutdown(self, wait: bool = True) -> None:
        self.run_all()


def wait_until(
    predicate: Callable[[], bool], what: str = "a condition", timeout_s: float = 10.0
) -> None:
    """Poll ``predicate`` (work that reports back on an I/O thread) until true; fail after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def mooncake_worker(
    stack: ExitStack, master: MooncakeMaster, capacity: int, segment: int, **cache_kwargs: Any
) -> EmbeddingCache:
    """A connected cache of ``capacity`` bytes over its own ``MooncakeStore`` on ``master``,
    lending a segment of ``segment`` bytes; closed by ``stack``, the store last. A worker that
    cannot reach the master fails here, saying why."""
    store = stack.enter_context(
        MooncakeStore(
            **master.store_kwargs(), global_segment_size=segment, reconnect_interval_s=0.2
        )
    )
    cache = EmbeddingCache(capacity, store=store, pin_memory=False, **cache_kwargs)
    stack.enter_context(cache)
    store.connect()
    return cache


def publishes_ended(cache: EmbeddingCache) -> bool:
    """Whether every publish ``cache`` started has ended (OK, FAILED or UNKNOWN)."""
    s = cache.stats()
    return s.publishes_started == s.publishes_ok + s.publishes_failed + s.publishes_unknown


def transfers_ended(cache: EmbeddingCache) -> bool:
    """Whether every publish and every load ``cache`` started has ended."""
    s = cache.stats()
    return publishes_ended(cache) and s.loads_started == (
        s.loads_ok + s.loads_failed + s.loads_unknown
    )


def assert_idle(cache: EmbeddingCache, timeout_s: float = 10.0) -> None:
    """Once every transfer ``cache`` started has ended (failing after ``timeout_s``): the
    invariants hold, no entry is pinned or LOADING, no request is open, and every allocated
    byte belongs to an entry."""
    wait_until(lambda: transfers_ended(cache), "the transfers to end", timeout_s)
    cache.check_invariants()
    s = cache.stats()
    assert s.pinned_entries == 0, s
    assert s.open_requests == 0, s
    assert s.entries_by_state.get("LOADING", 0) == 0, s
    assert s.allocated_bytes == sum(s.bytes_by_state.values()), s


def rss() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class FenceThread:
    """``cache.fence()`` on a thread of its own: a fence in flight, which the test lets end."""

    def __init__(self, cache: EmbeddingCache, wait_s: float) -> None:
        self.freed: int | None = None
        self._wait_s = wait_s
        self._thread = threading.Thread(target=self._run, args=(cache,), daemon=True)
        self._thread.start()

    def _run(self, cache: EmbeddingCache) -> None:
        self.freed = cache.fence()

    def join(self) -> int:
        """How many entries the fence freed; fails if it did not end within ``wait_s``."""
        self._thread.join(self._wait_s)
        assert not self._thread.is_alive() and self.freed is not None, "the fence did not end"
        return self.freed


def evict_idle_after_close(cache: EmbeddingCache) -> None:
    """Test harness: right after each of ``cache``'s requests closes, remove every idle entry,
    so (with ``poison_freed``) a view read after its request ended reads poison. It wraps
    ``cache.request`` and ``cache.lookup``, so the requests the pipeline opens are caught too."""
    open_request, open_lookup = cache.request, cache.lookup

    def evicting(request: Request) -> Request:
        close = request.close

        def close_then_evict() -> None:
            close()
            for key in cache.snapshot().eviction_order:
                cache.remove(key)

        request.close = close_then_evict  # type: ignore[method-assign]
        return request

    def request_then_evict(request_id: str) -> Request:
        return evicting(open_request(request_id))

    def lookup_then_evict(
        request_id: str, items: Sequence[Item], **options: bool
    ) -> tuple[Request, list[ItemStatus]]:
        request, statuses = open_lookup(request_id, items, **options)
        return evicting(request), statuses

    cache.request = request_then_evict  # type: ignore[method-assign]
    cache.lookup = lookup_then_evict  # type: ignore[method-assign]
