"""A driver that replays vLLM's per-step call order against our connector, for the vLLM tests.

vLLM's real interface modules come from its wheel (``tests.support.vllm_wheel``). The scheduler
connector is made by vLLM's own ``ECConnectorFactory``; each rank's connector by vLLM's
``ensure_ec_transfer_initialized`` and driven through vLLM's own
``ECConnectorModelRunnerMixin`` (``ProcessRank``: one spawned process per rank), or called in
the mixin's order in this process (``LocalRank``). ``Replay`` plays vLLM's scheduler: per step,
for each request with encoder inputs, ``ensure_cache_available`` (False defers it), then per
item vLLM's own encoder-cache check and ``has_cache_item``, then ``update_state_after_alloc``
for the items to encode before the ones to load (vLLM's ``_allocate_encoder_inputs``); then
``build_connector_meta``, the ranks' step (pickled ``SchedulerOutput`` in, acks out, merged by
``aggregate``), ``request_finished`` for requests that end (vLLM's ``_free_request``, in
``update_from_output``), and only then ``update_connector_output`` with the step's acks.

Every rank checks, as vLLM's ``_gather_mm_embeddings`` would, that each item of each
scheduled request is in its ``encoder_cache`` with the right bytes, shape and dtype.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.support import vllm_wheel
from tests.support.vllm_wheel import WIDTH, FakeRequest, vllm_config

DTYPE = torch.float16
__all__ = ["WIDTH", "FakeRequest", "vllm_config"]  # re-exported for the tests


def embedding(key: str, rows: int) -> torch.Tensor:
    """The encoder's output for ``key``: rows x WIDTH, a function of the key alone."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=gen).to(DTYPE)


@dataclass
class StepWork:
    """One step for a rank: the pickled SchedulerOutput and what vLLM's runner does with it."""

    scheduler_output: bytes
    encode: list[tuple[str, int]]  # (key, rows) encoded this step
    needed: list[tuple[str, int]]  # what _gather_mm_embeddings reads this step
    free: list[str]  # encoder-cache entries vLLM frees after the step


def run_step(
    connector: Any, encoder_cache: dict[str, torch.Tensor], work: StepWork
) -> tuple[Any, list[str]]:
    """One rank's step in the mixin's order; returns (its acks, what it found wrong)."""
    from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

    so = pickle.loads(work.scheduler_output)
    errors: list[str] = []
    mixin = ECConnectorModelRunnerMixin
    with mixin.maybe_get_ec_connector_output(so, encoder_cache) as output:
        for key, rows in work.encode:
            encoder_cache[key] = embedding(key, rows)
            mixin.maybe_save_ec_to_connector(encoder_cache, key)
        for key, rows in work.needed:
            got = encoder_cache.get(key)
            if got is None:
                errors.append(f"Encoder cache miss for {key}")
            elif got.dtype != DTYPE or tuple(got.shape) != (rows, WIDTH):
                errors.append(f"{key}: {got.dtype} {tuple(got.shape)}, wanted {(rows, WIDTH)}")
            elif not torch.equal(got, embedding(key, rows)):
                errors.append(f"{key}: wrong bytes")
    for key in work.free:
        encoder_cache.pop(key, None)
    return output.ec_connector_worker_meta, errors


def _rank_main(conn: Connection, role: str, extra: dict[str, Any], world: int, rank: int) -> None:
    """A rank's process: vLLM's own ec_transfer_state makes the connector; steps until None."""
    vllm_wheel.install()
    from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, get_ec_transfer

    ensure_ec_transfer_initialized(vllm_config(role, extra, world, rank))
    connector = get_ec_transfer()
    encoder_cache: dict[str, torch.Tensor] = {}
    conn.send(os.getpid())
    while (work := conn.recv()) is not None:
        acks, errors = run_step(connector, encoder_cache, work)
        conn.send(pickle.dumps((acks, errors)))
    conn.close()


class ProcessRank:
    """A rank in its own (spawned) process."""

    def __init__(self, role: str, extra: dict[str, Any], world: int, rank: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_rank_main, args=(child, role, extra, world, rank))
        self.process.start()
        child.close()
        if not self._conn.poll(120):
            raise TimeoutError(f"rank {rank} did not start")
        self.pid = self._conn.recv()
        self.alive = True

    def step(self, work: StepWork) -> tuple[Any, list[str]]:
        self._conn.send(work)
        acks, errors = pickle.loads(self._conn.recv())
        return acks, errors

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(30)
        self.alive = False

    def stop(self) -> None:
        if self.alive:
            self._conn.send(None)
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(30)
        self.alive = False


class LocalRank:
    """A rank in this process: its connector is made directly and stepped in the mixin's
    order (vLLM's ec_transfer_state holds one connector a process, so the mixin is not used).
    Its encoder outputs and loads live on ``device``; on CUDA each output is made behind about
    10 ms of work queued on the current stream, so a save that did not wait for it would copy
    bytes not yet written."""

    def __init__(
        self, role: str, extra: dict[str, Any], world: int, rank: int, device: str = "cpu"
    ) -> None:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        config = vllm_config(role, extra, world, rank, device)
        self.connector = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        self.device = torch.device(device)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.alive = True

    def _encode(self, key: str, rows: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return embedding(key, rows)
        torch.cuda._sleep(20_000_000)  # GPU clock cycles: the output is written late
        return embedding(key, rows).to(self.device, non_blocking=True)

    def step(self, work: StepWork) -> tuple[Any, list[str]]:
        c, cache = self.connector, self.encoder_cache
        so = pickle.loads(work.scheduler_output)
        c.bind_connector_metadata(so.ec_connector_metadata)
        if c.is_producer:
            c.start_save_caches(encoder_cache=cache)
        if c.is_consumer:
            c.start_load_caches(cache)
        errors: list[str] = []
        for key, rows in work.encode:
            cache[key] = self._encode(key, rows)
            c.save_caches(encoder_cache=cache, mm_hash=key)
        for key, rows in work.needed:
            got = cache.get(key)
            if got is None or got.device.type != self.device.type:
                errors.append(f"{key}: missing from rank's encoder_cache or on another device")
            elif not torch.equal(got.cpu(), embedding(key, rows)):
                errors.append(f"{key}: wrong bytes in rank's encoder_cache")
        acks = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        for key in work.free:
            cache.pop(key, None)
        return acks, errors

    def stop(self) -> None:
        self.alive = False


@dataclass
class ReplayReport:
    """What a replay saw."""

    steps: int = 0
    declared: int = 0  # has_cache_item True
    loads: int = 0
    encodes: int = 0
    deferred: int = 0
    dropped_acks: int = 0
    errors: list[str] = field(default_factory=list)
    dropped: list[Any] = field(default_factory=list)  # acks withheld, for late delivery


class Replay:
    """vLLM's scheduler loop over ``ranks``; see the module docstring."""

    def __init__(self, scheduler: Any, ranks: list[Any], *, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.ranks = ranks
        self.rng = random.Random(seed)
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.refs: dict[str, set[str]] = {}  # vLLM's encoder cache: key -> requests using it
        self.report = ReplayReport()

    def add(self, request: FakeRequest) -> None:
        self.waiting.append(request)

    def step(self, *, admit: int = 4, drop_ack: Callable[[int], bool] = lambda rank: False) -> None:
        """One engine step; ``drop_ack(rank)`` True loses that rank's acks of this step."""
        from vllm.v1.outputs import ECConnectorOutput

        sched = self.scheduler
        encode: dict[str, int] = {}
        needed: dict[str, int] = {}
        for request in list(self.waiting[:admit]):
            if not sched.ensure_cache_available(request, 0):
                self.report.deferred += 1
                continue
            self.waiting.remove(request)
            self.running.append(request)
            to_encode, to_load = [], []
            for index, key in enumerate(request.keys):
                rows = request.rows[key]
                needed[key] = rows
                users = self.refs.setdefault(key, set())
                if users or key in encode:  # vLLM's encoder cache has it (or will this step)
                    users.add(request.request_id)
                    continue
                users.add(request.request_id)
                if sched.has_cache_item(key):
                    self.report.declared += 1
                    self.report.loads += 1
                    to_load.append(index)
                else:
                    encode[key] = rows
                    self.report.encodes += 1
                    to_encode.append(index)
            for index in to_encode + to_load:  # vLLM allocates the encodes first
                sched.update_state_after_alloc(request, index)
        for request in self.running:
            for key in request.keys:
                needed[key] = request.rows[key]
        finished = [r for r in self.running if r.steps_left <= 1]
        free = [
            k
            for r in finished
            for k in r.keys
            if self.refs.get(k, set()) <= {x.request_id for x in finished}
        ]
        so = vllm_wheel.SchedulerOutput({r.request_id for r in finished})
        so.ec_connector_metadata = sched.build_connector_meta(so)
        work = StepWork(pickle.dumps(so), sorted(encode.items()), sorted(needed.items()), free)
        merged = None
        for rank, worker in enumerate(self.ranks):
            if not worker.alive:
                continue
            acks, errors = worker.step(work)
            self.report.errors += [f"step {self.report.steps} rank {rank}: {e}" for e in errors]
            if acks is not None and drop_ack(rank):
                self.report.dropped_acks += 1
                self.report.dropped.append(acks)
                continue
            if acks is not None:
                merged = acks if merged is None else merged.aggregate(acks)
        for request in self.running:
            request.steps_left -= 1
        for request in finished:  # vLLM's _free_request runs before the step's acks arrive
            self.running.remove(request)
            sched.request_finished(request)
            for key in request.keys:
                users = self.refs.get(key)
                if users is not None:
                    users.discard(request.request_id)
                    if not users:
                        del self.refs[key]
        if merged is not None:
            sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=merged))
        self.report.steps += 1

    def deliver(self, acks: Any) -> None:
        """Hand a withheld ack to the scheduler late."""
        from vllm.v1.outputs import ECConnectorOutput

        self.scheduler.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=acks))

    def drain(self, **kwargs: Any) -> None:
        """Step until no request waits or runs."""
        deadline = time.monotonic() + 60
        while self.waiting or self.running:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.waiting)} waiting, {len(self.running)} running")
            self.step(**kwargs)
            if self.report.deferred and not self.running:
                time.sleep(0.001)  # a store read is running; let it end


def rows_of(key: str) -> int:
    """How many embedding rows ``key``'s image has (8 to 32, a function of the key alone)."""
    return 8 * (1 + hashlib.sha256(key.encode()).digest()[0] % 4)


def requests(count: int, keys: int, *, seed: int, prefix: str = "img") -> list[FakeRequest]:
    """``count`` requests of 1-3 items each over ``keys`` keys (popular keys come back often),
    each running 1-3 steps."""
    rng = random.Random(seed)
    names = [f"{prefix}-{k}" for k in range(keys)]
    weights = [1 / (i + 1) for i in range(keys)]
    out = []
    for i in range(count):
        chosen = list(dict.fromkeys(rng.choices(names, weights, k=rng.randint(1, 3))))
        rows = {k: rows_of(k) for k in chosen}
        out.append(FakeRequest(f"req-{seed}-{i}", chosen, rows, rng.randint(1, 3)))
    return out


def settle(cache: Any, timeout: float = 30.0) -> Any:
    """``cache.stats()`` once no publish runs (a publish pins its entry while it runs)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = cache.stats()
        ended = stats.publishes_ok + stats.publishes_failed + stats.publishes_unknown
        if ended == stats.publishes_started or time.monotonic() > deadline:
            return stats
        time.sleep(0.005)


def pool_owner_main(conn: Connection, extra: dict[str, Any]) -> None:
    """A scheduler process that makes its connector, sends the pool's handle, and waits to be
    killed."""
    vllm_wheel.install()
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = vllm_config("ec_both", extra, 1)
    connector = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    conn.send(connector.build_connector_meta(vllm_wheel.SchedulerOutput()).pool)
    conn.recv()  # never comes: the test kills this process
