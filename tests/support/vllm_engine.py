"""vLLM 0.33.0's engine-step call order, played against any encoder-cache connector: one
scheduler-role connector and one worker-role connector per rank, in this process.

Per step, as ``vllm/v1/core/sched/scheduler.py`` does:

1. ``schedule()``: for every running request with media, ``ensure_cache_available`` (False:
   skipped this step); for a request's first step, per item: already in vLLM's encoder cache
   (another request scheduled it): shared, no connector call; else ``has_cache_item`` (True:
   an external load, else an encode); then ``_allocate_encoder_inputs``:
   ``update_state_after_alloc`` for the items to **encode first, then** for the ones to load
   (the order that breaks ``ECCPUConnector``: an encode allocation can evict what the same
   request was just told is present); then ``build_connector_meta``.
2. Every rank (``ECConnectorModelRunnerMixin``'s order): ``bind_connector_metadata``,
   ``start_save_caches`` (producer), ``start_load_caches`` (consumer), the encoder and
   ``save_caches`` per encoded item, ``get_finished``, ``build_connector_worker_meta``,
   ``clear_connector_metadata``; then it checks, as ``_gather_mm_embeddings`` would, that each
   item the step reads is in its ``encoder_cache`` with the right bytes.
3. ``update_from_output()``: ``request_finished`` for the requests that end (from
   ``_free_request``), **then** ``update_connector_output`` with the ranks' merged metadata.

Time in the scheduler-role calls is summed (``scheduler_ns``); ``on_scheduler_call(True)`` and
``(False)`` bracket each one (callgrind's toggles). The embeddings are a cheap deterministic
pattern of the key (``embedding``), so checking the bytes costs little.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support import vllm_wheel
from tests.support.vllm_wheel import FakeRequest

DTYPE = torch.float16
ANSWERS = ("ensure_cache_available", "has_cache_item")  # answers a replay must give again
_BASE: list[torch.Tensor] = []


def embedding(key: str, rows: int, width: int) -> torch.Tensor:
    """The encoder's output for ``key``: rows x width float16, a function of the key alone (a
    view of one random tensor at an offset of the key's hash: no arithmetic per call)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % 997
    need = seed * 64 + rows * width
    if not _BASE or _BASE[0].numel() < need:
        gen = torch.Generator().manual_seed(0)
        _BASE[:] = [torch.rand(max(need, 997 * 64 + (1 << 21)), generator=gen).to(DTYPE)]
    return _BASE[0][seed * 64 : need].view(rows, width)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape hold the same bytes (compared as int16: fast)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@dataclass
class EngineReport:
    """What a run saw: per item occurrence, how vLLM got it; the scheduler's time."""

    steps: int = 0
    images: int = 0  # item occurrences scheduled
    shared: int = 0  # already in vLLM's encoder cache: no connector call
    declared: int = 0  # has_cache_item said True
    encoded: int = 0
    loaded: int = 0  # declared items every rank found, with the right bytes
    missing: int = 0  # declared items some rank did not have ("Encoder cache miss"), once each
    wrong: int = 0  # items a rank had with the wrong bytes or shape
    deferred: int = 0
    scheduler_ns: int = 0
    scheduler_calls: int = 0
    load_ns: int = 0
    load_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def avoided(self) -> float:
        """The share of item occurrences vLLM did not encode."""
        return 1 - self.encoded / self.images if self.images else 0.0


class Engine:
    """vLLM's step loop (module docstring) over ``scheduler`` and ``workers`` (one per rank)."""

    def __init__(
        self,
        scheduler: Any,
        workers: list[Any],
        width: int,
        *,
        admit: int = 4,
        check_bytes: bool = True,
        on_scheduler_call: Callable[[bool], None] | None = None,
        after_each_step: Callable[[], None] | None = None,
        record: list[tuple[str, tuple[Any, ...], Any]] | None = None,
    ) -> None:
        self.scheduler, self.workers, self.width = scheduler, workers, width
        self.admit, self.check_bytes = admit, check_bytes
        self.toggle = on_scheduler_call
        self.after_each_step = after_each_step
        self.record = record  # every scheduler-role call, for ``replay_scheduler``
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.started: set[str] = set()
        self.refs: dict[str, set[str]] = {}  # vLLM's encoder cache: key -> requests using it
        self.caches: list[dict[str, torch.Tensor]] = [{} for _ in workers]
        self.to_free: list[str] = []
        self.report = EngineReport()

    def add(self, request: FakeRequest) -> None:
        self.waiting.append(request)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        toggle = self.toggle
        if toggle is not None:
            toggle(True)
        start = time.perf_counter_ns()
        result = fn(*args)
        self.report.scheduler_ns += time.perf_counter_ns() - start
        if toggle is not None:
            toggle(False)
        self.report.scheduler_calls += 1
        if self.record is not None:
            name = "has_cache_item" if fn.__name__ == "__contains__" else fn.__name__
            saved = (pickle.dumps(args[0].ec_connector_worker_meta),) if "output" in name else args
            answer = result if name in ANSWERS else None
            self.record.append((name, saved, answer))
        return result

    def step(self) -> None:
        """One engine step."""
        from vllm.v1.outputs import ECConnectorOutput

        sched, report, call = self.scheduler, self.report, self._call
        encode: dict[str, int] = {}
        declared: dict[str, int] = {}
        needed: dict[str, int] = {}
        admitted = self.waiting[: self.admit]
        for request in [*self.running, *admitted]:
            if not call(sched.ensure_cache_available, request, 0):
                report.deferred += 1
                continue
            if request.request_id in self.started:
                continue
            self.started.add(request.request_id)
            if request in admitted:
                self.waiting.remove(request)
                self.running.append(request)
            to_encode, to_load = [], []
            for index, key in enumerate(request.keys):
                report.images += 1
                users = self.refs.setdefault(key, set())
                if users or key in encode:
                    users.add(request.request_id)
                    report.shared += 1
                    continue
                users.add(request.request_id)
                rows = request.rows[key]
                needed[key] = rows
                if call(sched.has_cache_item, key):
                    report.declared += 1
                    declared[key] = rows
                    to_load.append(index)
                else:
                    report.encoded += 1
                    encode[key] = rows
                    to_encode.append(index)
            for index in to_encode + to_load:  # vLLM allocates the encodes first
                call(sched.update_state_after_alloc, request, index)
        finished = [r for r in self.running if r.steps_left <= 1]
        so = vllm_wheel.SchedulerOutput({r.request_id for r in finished})
        so.ec_connector_metadata = call(sched.build_connector_meta, so)
        merged = None
        missing: set[str] = set()
        for rank, worker in enumerate(self.workers):
            acks = self._rank_step(rank, worker, so, encode, needed, declared, missing)
            if acks is not None:
                merged = acks if merged is None else merged.aggregate(acks)
        report.missing += len(missing)
        for request in self.running:
            request.steps_left -= 1
        self.to_free = []
        for request in finished:
            self.running.remove(request)
            self.started.discard(request.request_id)
            call(sched.request_finished, request)
            for key in request.keys:
                users = self.refs.get(key)
                if users is not None:
                    users.discard(request.request_id)
                    if not users:
                        del self.refs[key]
                        self.to_free.append(key)
        if merged is not None:
            call(sched.update_connector_output, ECConnectorOutput(ec_connector_worker_meta=merged))
        report.steps += 1
        if self.after_each_step is not None:
            self.after_each_step()

    def _rank_step(
        self,
        rank: int,
        worker: Any,
        so: Any,
        encode: dict[str, int],
        needed: dict[str, int],
        declared: dict[str, int],
        missing: set[str],
    ) -> Any:
        cache = self.caches[rank]
        for key in self.to_free:
            cache.pop(key, None)
        worker.bind_connector_metadata(so.ec_connector_metadata)
        if worker.is_producer:
            worker.start_save_caches(encoder_cache=cache)
        if worker.is_consumer:
            start = time.perf_counter_ns()
            worker.start_load_caches(cache)
            self.report.load_ns += time.perf_counter_ns() - start
        for key, rows in encode.items():
            cache[key] = embedding(key, rows, self.width)
            worker.save_caches(encoder_cache=cache, mm_hash=key)
        worker.get_finished(so.finished_req_ids)
        acks = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        step = self.report.steps
        for key, rows in needed.items():
            got = cache.get(key)
            if got is None:
                if key in declared:
                    missing.add(key)
                self.report.errors.append(f"step {step} rank {rank}: Encoder cache miss {key}")
            elif tuple(got.shape) != (rows, self.width) or (
                self.check_bytes and not same_bytes(got, embedding(key, rows, self.width))
            ):
                self.report.wrong += 1
                self.report.errors.append(f"step {step} rank {rank}: wrong bytes for {key}")
            elif rank == len(self.workers) - 1 and key in declared:
                self.report.loaded += 1
                self.report.load_bytes += got.nbytes
        return acks

    def drain(self) -> EngineReport:
        """Step until no request waits or runs."""
        while self.waiting or self.running:
            self.step()
        return self.report


def replay_scheduler(
    scheduler: Any,
    script: list[tuple[str, tuple[Any, ...], Any]],
    on_call: Callable[[bool], None] | None = None,
    *,
    check: bool = True,
) -> None:
    """Make ``script``'s scheduler-role calls (an ``Engine``'s ``record``) on a fresh
    ``scheduler``, in order, with no worker in this process (as in vLLM, whose ranks are other
    processes, so their copies do not run on the scheduler's core). With ``check``, every
    ``ensure_cache_available`` and ``has_cache_item`` must answer as in the recorded run."""
    from vllm.v1.outputs import ECConnectorOutput

    for name, args, answer in script:
        if name == "update_connector_output":
            args = (ECConnectorOutput(ec_connector_worker_meta=pickle.loads(args[0])),)
        fn = getattr(scheduler, name)  # as vLLM calls it: self.ec_connector.<name>(...)
        if on_call is not None:
            on_call(True)
        result = fn(*args)
        if on_call is not None:
            on_call(False)
        if check and answer is not None and result != answer:
            raise AssertionError(f"replayed {name}{args!r} answered {result}, not {answer}")


def workload(
    requests: int = 300,
    images: int = 500,
    *,
    seed: int = 0,
    rows: tuple[int, int] = (64, 2048),
    per_request: tuple[int, int] = (1, 4),
    steps: tuple[int, int] = (1, 3),
    prefix: str = "img",
) -> list[FakeRequest]:
    """``requests`` requests of 1-4 images drawn Zipf(1) over ``images`` images of 64-2048
    rows each (a function of the image), each running 1-3 steps."""
    rng = random.Random(seed)
    names = [f"{prefix}-{k}" for k in range(images)]
    size = {n: random.Random(f"{seed}/{n}").randint(*rows) for n in names}
    weights = [1 / (i + 1) for i in range(images)]
    out = []
    for i in range(requests):
        count = rng.randint(*per_request)
        chosen = list(dict.fromkeys(rng.choices(names, weights, k=count)))
        rows_of = {k: size[k] for k in chosen}
        out.append(FakeRequest(f"req-{seed}-{i}", chosen, rows_of, rng.randint(*steps)))
    return out


def working_set(requests: list[FakeRequest], width: int) -> int:
    """The bytes of the distinct items ``requests`` name (each as large as its bytes)."""
    rows = {key: request.rows[key] for request in requests for key in request.keys}
    return sum(rows.values()) * width * DTYPE.itemsize


def ideal_lru(requests: list[FakeRequest], capacity: int, width: int) -> float:
    """The share of item occurrences an LRU of ``capacity`` bytes (no fragmentation, no pins,
    items only as large as their bytes) would serve, over the requests in order."""
    from collections import OrderedDict

    lru: OrderedDict[str, int] = OrderedDict()
    used = hits = total = 0
    for request in requests:
        for key in request.keys:
            total += 1
            if key in lru:
                hits += 1
                lru.move_to_end(key)
                continue
            size = request.rows[key] * width * DTYPE.itemsize
            if size > capacity:
                continue
            while used + size > capacity:
                _, freed = lru.popitem(last=False)
                used -= freed
            lru[key] = size
            used += size
    return hits / total if total else 0.0
