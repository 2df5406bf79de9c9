"""MMEncoder's serving sequence through embcache's SGLang controller vs SGLang's own controller.

Both controllers run the same calls per request, in MMEncoder's order (CPU output path):
- a hit request: ``batch_is_exist``, ``prefetch``, ``check_prefetch_progress`` until True,
  ``has_local_embedding`` per item, ``get_embedding_dim``, ``get_pool_views``, the assembly
  copy of every view into one output tensor, ``release_pool_views``;
- a miss request: ``batch_is_exist`` (it asks the global store), ``store_to_pool_async`` of the
  fresh outputs, ``get_embedding_dim``, the assembly copy, ``wait_store_to_pool``,
  ``insert_batch``. The pool holds about half the keys, so misses evict.
SGLang's controller is 0.5.23's, run from its wheel (``tests.support.sglang_wheel``; rows say
skipped when the wheel cannot be had). Its IO thread (a loop that polls two queues every
millisecond) is replaced by one that blocks on the PUT queue and runs each PUT as that loop
does (the store's ``batch_put_from_multi_buffers``, then the controller's own
``_finish_put``): the 1 ms polling would steal the interpreter from both sides at random. So
on both sides the publish runs on a worker thread, as in production, and is not waited for
within a request; between requests, untimed, the run waits for SGLang's PUTs on its own signal
(its insert queue's ``join``), since a PUT holds its pages until it ends. Its
``store_to_pool_async`` takes CUDA tensors only, so on a CPU host its steps are taken with a
CPU tensor (as in ``benchmarks.peers.bench_peers``): under its lock the same checks, its
``_allocate_with_eviction`` and a FILLING entry, then the copy by its own
``_copy_embedding_page_runs`` (its CPU path), and a handle without an event that its own
``wait_store_to_pool`` then marks READY. Ours gets the CPU tensors as they are. Both global
stores hold nothing and drop every put (SGLang: ``NullStore``; ours: ``NullGlobalStore``), so
no store work is timed on either side. Sizes: small items (8 tokens x 16 bf16 = 256 B, SGLang
pages of one item) and real ones (576 tokens x 3584 bf16, 3.9 MiB; SGLang's 256 KiB pages).
The sides take turns request by request; medians per request; ratio = SGLang's time / ours
(at or above 1: ours is no slower).
Run from the repository root: python -m benchmarks.peers.bench_sglang_adapter [--quick | --tiny]
[--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import make_row, print_rows, skipped_row
from embcache.core.outcomes import TransferOutcome
from embcache.integrations.sglang import EmbeddingCacheController
from tests.support import sglang_wheel
from tests.support.rows import json_row

TARGET = ">= 1.0x"
DTYPE = torch.bfloat16


class NullGlobalStore:
    """An embcache ``GlobalStore`` that holds nothing: every key is missing, every get fails,
    every put succeeds and is dropped (``sglang_wheel.NullStore``'s twin)."""

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Accept the pool."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """No key exists."""
        return [False] * len(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Every get fails before any transfer."""
        return [-704] * len(keys)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Every put succeeds and is dropped."""
        return [0] * len(keys)

    def classify(self, code: int) -> TransferOutcome:
        """Nothing is ever in flight."""
        return TransferOutcome.FAILED

    def fence(self) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class Size:
    """One item size and the pool and pages it is measured with."""

    name: str
    tokens: int
    dim: int
    items: int  # per request
    pool_items: int  # the pool holds this many
    page_bytes: int  # SGLang's page size


SMALL = Size("256 B items", 8, 16, 8, 512, 256)
REAL = Size("3.9 MiB items", 576, 3584, 4, 40, sglang_wheel.DEFAULT_PAGE_BYTES)
# --tiny (the test's smoke run, 20 requests): a pool of 64 items. Between requests the run
# waits for SGLang's PUTs (``SGLangSide.settle``): with a pool of 16 and no such wait, a putter
# 3 requests behind (seen twice on a loaded machine) left no free pages, SGLang skipped the
# insert and the next hit request found a miss.
TINY = Size("tiny", 8, 16, 4, 64, 256)


class SGLangSide:
    """SGLang's controller with a CPU ``store_to_pool_async`` (module docstring)."""

    def __init__(self, size: Size) -> None:
        self.module = sglang_wheel.load_controller_module()
        nbytes = size.tokens * size.dim * DTYPE.itemsize
        self.controller = sglang_wheel.make_controller(
            size.pool_items * nbytes, size.dim, DTYPE, size.page_bytes
        )
        self.modality = sglang_wheel.image_modality()
        sglang_wheel.stop_io(self.controller)
        self.putter = threading.Thread(target=self._put_loop, daemon=True)
        self.putter.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.controller, name)

    def _put_loop(self) -> None:
        """The PUT half of its IO loop, blocking instead of polling; None ends it. Each op is
        marked done (``task_done``) after its ``_finish_put``, as SGLang's own loop does."""
        controller = self.controller
        while True:
            op = controller.insert_queue.get()
            try:
                if op is None:
                    return
                results = controller.embedding_store.batch_put_from_multi_buffers(
                    op.keys, op.ptrs, op.sizes
                )
                controller._finish_put(op, results)
            finally:
                controller.insert_queue.task_done()

    def settle(self) -> None:
        """Return once every PUT issued so far has finished and released its pins: SGLang's
        own completion signal, its insert queue's ``join`` (``task_done`` after each
        ``_finish_put``). A PUT still running holds its entries' pages: a next request's
        insert may then find no free page, and SGLang skips it."""
        self.controller.insert_queue.join()

    def store_to_pool_async(
        self, mm_hashes: list[str], tensors: list[torch.Tensor], modality: Any
    ) -> list[Any]:
        controller, module = self.controller, self.module
        pool = controller._get_pool(modality)
        pending = []
        with controller.lock:
            for key, tensor in zip(mm_hashes, tensors, strict=True):
                if tensor.shape[-1] != pool.dim:
                    continue
                entry = controller.entries.get(key)
                if entry is not None:
                    if entry.state == module.EntryState.READY:
                        controller._lru_touch(key)
                    continue
                runs = controller._allocate_with_eviction(pool, tensor.shape[0])
                if runs is None:
                    continue
                entry = module.EmbeddingCacheEntry(
                    hash=key,
                    modality=modality,
                    num_tokens=tensor.shape[0],
                    dim=pool.dim,
                    page_runs=runs,
                    state=module.EntryState.FILLING,
                )
                controller.entries[key] = entry
                pending.append((tensor, entry))
        handles = []
        for tensor, entry in pending:
            controller._copy_embedding_page_runs(
                src=tensor, dst=pool.tensor, entry=entry, pool=pool, src_is_pool=False
            )
            handles.append((entry, module.AsyncCopyHandle(None, entry.hash)))
        return handles

    def close(self) -> None:
        self.controller.insert_queue.put(None)
        self.putter.join()


class LRUController(EmbeddingCacheController):
    """The adapter with ``lru``, like for like with SGLang's LRU controller: the default policy
    (``adaptive-work``) may refuse to keep a fresh output, and this run's hit requests read the
    previous request's fresh outputs (a refused one made a hit request find a miss)."""

    cache_policy = "lru"


def ours(size: Size) -> EmbeddingCacheController:
    nbytes = size.tokens * size.dim * DTYPE.itemsize
    return LRUController(
        NullGlobalStore(),
        max_pool_size_gb=size.pool_items * nbytes / (1 << 30),
        hidden_dims={"IMAGE": size.dim},
        dtype=DTYPE,
    )


class Driver:
    """MMEncoder's calls on one controller (module docstring), one request at a time."""

    def __init__(self, controller: Any, modality: Any, size: Size) -> None:
        self.controller = controller
        self.modality = modality
        self.size = size
        self.loop = asyncio.new_event_loop()
        self.out = torch.empty((size.tokens * size.items, size.dim), dtype=DTYPE)

    def hit(self, req_id: str, keys: list[str]) -> None:
        c, n = self.controller, self.size.tokens
        exist = self.loop.run_until_complete(c.batch_is_exist(keys))
        assert all(exist), f"a hit request found a miss: {type(c).__name__} {keys} {exist}"
        c.prefetch(req_id, keys, [n] * len(keys), self.modality)
        while not c.check_prefetch_progress(req_id):
            time.sleep(0.0001)
        assert all(c.has_local_embedding(k) for k in keys)
        dim = c.get_embedding_dim(self.modality)
        views = c.get_pool_views(keys)
        try:
            offset = 0
            for runs in views:
                for view in runs:
                    self.out[offset : offset + view.shape[0], :dim].copy_(view)
                    offset += view.shape[0]
        finally:
            c.release_pool_views(keys)

    def miss(self, keys: list[str], fresh: list[torch.Tensor]) -> None:
        c = self.controller
        exist = self.loop.run_until_complete(c.batch_is_exist(keys))
        assert not any(exist), "a miss request found a hit"
        handles = c.store_to_pool_async(keys, fresh, self.modality)
        dim = c.get_embedding_dim(self.modality)
        offset = 0
        for tensor in fresh:
            self.out[offset : offset + tensor.shape[0], :dim].copy_(tensor)
            offset += tensor.shape[0]
        c.wait_store_to_pool(handles)
        c.insert_batch(keys, self.modality)

    def close(self) -> None:
        self.loop.close()


def measure(size: Size, requests: int) -> dict[str, float]:
    """Median seconds per item of 'ours hit', 'ours miss', 'sglang hit', 'sglang miss'.

    Request n of a side misses on fresh keys, then hits on request n-1's keys (the newest,
    never evicted). The sides take turns request by request, the order swapped every request,
    so that a burst of load on a shared machine hits both alike; the first tenth warms up."""
    fresh = [torch.randn(size.tokens, size.dim).to(DTYPE) for _ in range(size.items)]
    ours_side = ours(size)
    sglang_side = SGLangSide(size)
    drivers = {
        "ours": Driver(ours_side, "IMAGE", size),
        "sglang": Driver(sglang_side, sglang_side.modality, size),
    }
    times: dict[str, list[float]] = {f"{n} {k}": [] for n in drivers for k in ("hit", "miss")}

    def keys(n: int) -> list[str]:
        return [f"k{n}-{i}" for i in range(size.items)]

    try:
        for driver in drivers.values():
            driver.miss(keys(0), fresh)
        warm = requests // 10
        for n in range(1, warm + requests + 1):
            order = list(drivers.items()) if n % 2 else list(drivers.items())[::-1]
            for name, driver in order:
                start = time.perf_counter()
                driver.miss(keys(n), fresh)
                middle = time.perf_counter()
                driver.hit(f"r{n}", keys(n - 1))
                end = time.perf_counter()
                if n > warm:
                    times[f"{name} miss"].append(middle - start)
                    times[f"{name} hit"].append(end - middle)
            sglang_side.settle()  # untimed: its PUTs of this request end before the next
        cache = ours_side.cache
        while cache.stats().publishes_ok < cache.stats().publishes_started:
            time.sleep(0.001)  # the last request's publishes
        cache.check_invariants()
        stats = cache.stats()
        assert stats.pinned_entries == 0 and stats.evictions > 0, stats
    finally:
        for driver in drivers.values():
            driver.close()
        ours_side.close()
        sglang_side.close()
    return {name: statistics.median(t) / size.items for name, t in times.items()}


def run(quick: bool = False, tiny: bool = False) -> list[dict[str, Any]]:
    """us per item of MMEncoder's hit and miss requests, ours vs SGLang's controller."""
    plans = [(SMALL, 500), (REAL, 40)] if quick else [(SMALL, 4000), (REAL, 300)]
    if tiny:
        plans = [(TINY, 20)]
    rows: list[dict[str, Any]] = []
    try:
        sglang_wheel.load_controller_module()
    except sglang_wheel.SGLangUnavailable as exc:
        return [
            skipped_row(f"MMEncoder {kind} request, {size.name}, vs SGLang", str(exc), TARGET)
            for size, _ in plans
            for kind in ("hit", "miss")
        ]
    for size, requests in plans:
        cost = measure(size, requests)
        for kind in ("hit", "miss"):
            mine, theirs = cost[f"ours {kind}"], cost[f"sglang {kind}"]
            rows.append(
                make_row(
                    f"MMEncoder {kind} request, {size.name}, vs SGLang",
                    mine * 1e6,
                    theirs * 1e6,
                    "us/item",
                    theirs / mine,
                    TARGET,
                    theirs >= mine,
                )
            )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="4 items of 256 B, 20 requests")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the rows as a JSON list")
    args = parser.parse_args()
    result = run(args.quick, args.tiny)
    print_rows(result)
    if args.json is not None:
        args.json.write_text(json.dumps([json_row(r) for r in result], indent=1) + "\n")
