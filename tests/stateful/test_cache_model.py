"""The real EmbeddingCache and the reference model, driven by the same steps, compared exactly.

Half the runs take no trace, so the core's untraced fast paths are the ones compared; the
other half take one, as trace validation does. The asynchronous parts are separate rules: the
cache's I/O executor is a queue (``io_executor``) that a rule runs one task at a time (a batch
of loads, or of publishes), so Hypothesis explores the interleavings of lookups, completions,
releases, removes and fences deterministically. A fence is also two rules: ``begin_fence`` runs
``fence()`` on a thread whose store fence waits, ``end_fence`` lets one of those in flight end,
so fences overlap with loads, UNKNOWN outcomes, removes and each other, and the model says what
each must free. Store faults (fail, unknown, short, raise) and other workers' puts and deletes
are rules too. Most runs keep a backlog of failed publishes (``RepublishPolicy``, 1-3 entries,
its thread off): store outages (every write FAILED or UNKNOWN), the store's return, a request
publishing again and the republisher's retry step (``retry_publishes``: the probe or all) are
rules, and the backlog's size, drops, stale retries and dropped retries in flight are compared
with ``models.backlog``. After every step the whole observable state is compared,
``check_invariants()`` runs, and every view a request holds must carry exactly the bytes that
were stored for its key.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, ClassVar

import hypothesis.strategies as st
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from embcache import EmbeddingCache, Item
from embcache.core.policy import make_policy
from embcache.driver.backlog import RepublishPolicy
from embcache.driver.trace import TraceLog
from embcache.testing import Fault, FaultInjectingStore
from models.cache import ModelCache
from tests.support.helpers import FenceThread, ManualExecutor

ALIGN = 256
KEYS = ["k0", "k1", "k2", "k3", "k4"]
CANONICAL = {
    "k0": ((64,), torch.float32),
    "k1": ((3, 50), torch.bfloat16),
    "k2": ((128,), torch.float32),
    "k3": ((100,), torch.uint8),
    "k4": ((200,), torch.float32),
}
ALTERNATE = ((8,), torch.float16)
REQUESTS = ["r0", "r1", "r2"]
# Small knobs, so halvings, shift resets and switches between experts happen within a run.
KNOBS: dict[str, dict[str, Any]] = {
    "lru": {},
    "tinylfu": {"min_entries": 1, "shift_block": 4},
    "adaptive": {"min_entries": 1, "shift_block": 4, "decay": 0.5},
    "adaptive-work": {"min_entries": 1, "shift_block": 4, "decay": 0.5},
}
WORK_S = [0.0, 0.001, 0.5, 2.0]  # encoder seconds an insert may report (ties, zero, spread)
WAIT_S = 600.0  # bounds the waits on fence threads (they end within steps, when let through)
FAULTS = {"fail": Fault.FAIL, "unknown": Fault.UNKNOWN, "short": Fault.SHORT, "raise": Fault.RAISE}


def payload(key: str, nbytes: int) -> bytes:
    """The bytes every worker stores for ``key`` at this size (a checksum stream of the key)."""
    out = b""
    counter = 0
    while len(out) < nbytes:
        out += hashlib.sha256(f"{key}:{nbytes}:{counter}".encode()).digest()
        counter += 1
    return out[:nbytes]


def tensor_for(item: Item) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(payload(item.key, item.nbytes)), dtype=torch.uint8)
    return raw.view(item.dtype).view(item.shape).clone()


class GatedStore(FaultInjectingStore):
    """A ``FaultInjectingStore`` whose next ``fence()`` after ``hold_next()`` waits for its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[threading.Event] = []
        self._hold = False
        self._cv = threading.Condition()

    def hold_next(self) -> int:
        """Hold the next store fence; returns the index of its gate."""
        with self._cv:
            self._hold = True
            return len(self.gates)

    def gate(self, index: int) -> threading.Event:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.gates) > index, WAIT_S), "no fence began"
            return self.gates[index]

    def fence(self) -> None:
        with self._cv:
            held, self._hold = self._hold, False
            gate = threading.Event()
            if held:
                self.gates.append(gate)
                self._cv.notify_all()
        if held:
            # Long: a fence may stay in flight for many steps on a loaded machine; teardown
            # opens every gate, so this bound only stops a thread that would hang.
            assert gate.wait(WAIT_S), "a held store fence was never let through"
        super().fence()


def as_tuple(status: Any) -> tuple[str, str | None]:
    return (status.status.name, None if status.reason is None else status.reason.value)


class CacheMachine(RuleBasedStateMachine):
    #: When set, every finished example appends its trace (a list of events) here.
    trace_sink: ClassVar[list[list[dict[str, Any]]] | None] = None

    @initialize(
        units=st.integers(3, 12),
        max_batch=st.integers(1, 4),
        eviction=st.booleans(),
        policy=st.sampled_from(list(KNOBS)),
        traced=st.booleans(),
        backlog=st.sampled_from([None, 1, 2, 3]),
    )
    def setup(
        self,
        units: int,
        max_batch: int,
        eviction: bool,
        policy: str,
        traced: bool,
        backlog: int | None,
    ) -> None:
        self.store = GatedStore()
        self.fencing: list[tuple[FenceThread, threading.Event, int]] = []  # fences in flight
        # Untraced, the core takes its fast paths (no event built); traced, the paths the trace
        # validation sees: one body either way, compared with the model step by step.
        self.trace = TraceLog() if traced or type(self).trace_sink is not None else None
        self.io = ManualExecutor()
        self.cache = EmbeddingCache(
            units * ALIGN,
            store=self.store,
            alignment=ALIGN,
            max_eviction_batch=max_batch,
            enable_eviction=eviction,
            pin_memory=False,
            trace=self.trace,
            policy=make_policy(policy, **KNOBS[policy]),
            auto_fence=None,  # fences are a rule here
            io_executor=self.io,
            # the backlog with no thread: a rule runs each retry (``retry_publishes``)
            republish=None
            if backlog is None
            else RepublishPolicy(max_entries=backlog, background=False),
        )
        self.model = ModelCache(
            units * ALIGN, ALIGN, max_batch, eviction, policy, backlog, **KNOBS[policy]
        )
        self.handles: dict[str, Any] = {}

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        try:
            while self.fencing:
                self.end_fence(0)  # one at a time: the model ends them in this order too
        finally:
            for _, gate, _ in self.fencing:
                gate.set()  # after a failure: no fence thread is left waiting
        while self.io.tasks:
            self.run_task(0)
        for r in list(self.handles):
            self.close_request(r)
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.pinned_entries == 0
        assert stats.entries_by_state.get("LOADING", 0) == 0
        assert stats.allocated_bytes == sum(e.size for e in self.model.entries.values())
        self.cache.close()
        if type(self).trace_sink is not None and self.trace is not None:
            type(self).trace_sink.append(self.trace.events)

    # -- requests --
    @rule(r=st.sampled_from(REQUESTS))
    def open_request(self, r: str) -> None:
        if r in self.handles:
            return
        self.handles[r] = self.cache.request(r)
        self.model.open_request(r)

    @rule(r=st.sampled_from(REQUESTS))
    def close_request(self, r: str) -> None:
        if r not in self.handles:
            return
        self.handles.pop(r).close()
        self.model.close_request(r)

    @rule(
        r=st.sampled_from(REQUESTS),
        picks=st.lists(
            st.tuples(st.sampled_from([*KEYS, "big"]), st.integers(0, 5)), min_size=1, max_size=4
        ),
        prefetch=st.booleans(),
        reserve=st.booleans(),
    )
    def lookup(self, r: str, picks: list[tuple[str, int]], prefetch: bool, reserve: bool) -> None:
        if r not in self.handles:
            return
        items = [self.item(key, variant) for key, variant in picks]
        real = [
            as_tuple(s)
            for s in self.handles[r].lookup(items, prefetch=prefetch, reserve_misses=reserve)
        ]
        model = self.model.lookup(r, [self.model_item(it) for it in items], prefetch, reserve)
        assert real == model, (real, model)

    @rule(r=st.sampled_from(REQUESTS), key=st.sampled_from(KEYS))
    def lookup_other_shape(self, r: str, key: str) -> None:
        """A present key looked up with another shape and dtype: a miss that pins nothing and
        leaves the eviction order alone (compared after the step)."""
        if key in self.model.entries:
            self.lookup(r, [(key, 5)], prefetch=False, reserve=False)

    @rule(r=st.sampled_from(REQUESTS), key=st.sampled_from(KEYS), other=st.sampled_from(KEYS))
    def lookup_repeated(self, r: str, key: str, other: str) -> None:
        """A key repeated in one lookup: one pin, the status of its first occurrence."""
        self.lookup(r, [(key, 0), (other, 0), (key, 0)], prefetch=True, reserve=False)

    @rule(r=st.sampled_from(REQUESTS), data=st.data(), publish=st.booleans())
    def insert(self, r: str, data: st.DataObject, publish: bool) -> None:
        if r not in self.handles:
            return
        reserved = sorted(self.model.requests[r].reserved)
        keys = data.draw(st.lists(st.sampled_from([*KEYS, *reserved]), min_size=1, max_size=3))
        items = []
        for key in keys:
            entry = self.model.entries.get(key)
            if key in reserved and entry is not None:
                items.append(Item(key, entry.shape, entry.dtype))  # type: ignore[arg-type]
            else:
                items.append(self.item(key, 0))
        work = data.draw(  # measured encoder seconds, or none (unknown)
            st.none() | st.lists(st.sampled_from(WORK_S), min_size=len(items), max_size=len(items))
        )
        self.insert_items(r, items, publish, work)

    def insert_items(
        self, r: str, items: list[Item], publish: bool, work: list[float] | None = None
    ) -> None:
        real = self.handles[r].insert(
            [it.key for it in items], [tensor_for(it) for it in items], publish=publish, work=work
        )
        model = self.model.insert(r, [self.model_item(it) for it in items], publish, work)
        assert real == model, (real, model)

    @rule(r=st.sampled_from(REQUESTS), key=st.sampled_from(KEYS))
    def load_unknown(self, r: str, key: str) -> None:
        """A store read of ``key`` that ends UNKNOWN (three rules in one: the fault, the
        lookup, the completion), so that a key is QUARANTINED again within a few steps."""
        if r not in self.handles or key in self.model.entries:
            return
        self.store_put(key, 0)
        self.store_fault(key, "unknown")
        self.lookup(r, [(key, 0)], prefetch=True, reserve=False)
        if self.io.tasks:
            self.run_task(len(self.io.tasks) - 1)

    # -- asynchronous completions --
    @precondition(lambda self: bool(getattr(self, "io", None) and self.io.tasks))
    @rule(data=st.data())
    def run_task(self, data: st.DataObject | int) -> None:
        n = len(self.io.tasks)
        index = data if isinstance(data, int) else data.draw(st.integers(0, n - 1))
        self.io.run(index)
        self.model.run_task(index)

    # -- the store and the outside world --
    @rule(key=st.sampled_from(KEYS), delta=st.sampled_from([0, 0, 16, -16]))
    def store_put(self, key: str, delta: int) -> None:
        shape, dtype = CANONICAL[key]
        nbytes = Item(key, shape, dtype).nbytes + delta
        self.store.delete(key)
        self.store.put_object(key, payload(key, nbytes))
        self.model.store[key] = nbytes

    @rule(key=st.sampled_from(KEYS))
    def store_delete(self, key: str) -> None:
        self.store.delete(key)
        self.model.store.pop(key, None)

    @rule(key=st.sampled_from(KEYS), fault=st.sampled_from([None, *FAULTS]))
    def store_fault(self, key: str, fault: str | None) -> None:
        self.store.inject(key, None if fault is None else FAULTS[fault])
        if fault is None:
            self.model.faults.pop(key, None)
        else:
            self.model.faults[key] = fault

    # -- publishes and the backlog of failed ones --
    @rule(r=st.sampled_from(REQUESTS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def publish(self, r: str, keys: list[str]) -> None:
        """A request publishes keys it holds again (a key that failed may fail again)."""
        if r not in self.handles:
            return
        assert self.handles[r].publish(keys) == self.model.publish(r, keys)

    @precondition(lambda self: getattr(self, "model", None) and self.model.backlog is not None)
    @rule(
        r=st.sampled_from(REQUESTS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
        fault=st.sampled_from(["fail", "fail", "short", "unknown"]),
        end=st.booleans(),
    )
    def publish_in_outage(self, r: str, keys: list[str], fault: str, end: bool) -> None:
        """An insert published while the store is down for its keys, its write ended or not
        (four rules in one: the request, the faults, the insert, the completion), so that
        within a few steps the backlog fills, drops (retries in flight too) and is retried."""
        keys = [k for k in keys if k not in self.model.entries]
        if not keys:
            return
        self.open_request(r)
        for key in keys:
            self.store_fault(key, fault)
        self.insert_items(r, [self.item(key, 0) for key in keys], publish=True)
        if end and self.io.tasks:
            self.run_task(len(self.io.tasks) - 1)

    @rule(fault=st.sampled_from(["fail", "unknown"]))
    def store_outage(self, fault: str) -> None:
        """The store goes down for every key: its writes end FAILED (unreachable) or UNKNOWN
        (cut off part-way)."""
        for key in KEYS:
            self.store_fault(key, fault)

    @rule()
    def store_returns(self) -> None:
        for key in KEYS:
            self.store_fault(key, None)

    @precondition(lambda self: bool(getattr(self, "model", None) and self.model.backlog))
    @rule(limit=st.sampled_from([None, 1, 2]))
    def retry(self, limit: int | None) -> None:
        """The republisher's step (its thread is off): the probe (1) or all that waits."""
        assert self.cache.retry_publishes(limit) == self.model.retry(limit)

    # -- removal and fence --
    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: str) -> None:
        assert self.cache.remove(key) == self.model.remove(key)

    @rule()
    def clear(self) -> None:
        assert self.cache.clear() == self.model.clear()

    @rule()
    def fence(self) -> None:
        assert self.cache.fence() == self.model.fence()

    @precondition(lambda self: len(getattr(self, "fencing", ())) < 2)
    @rule()
    def begin_fence(self) -> None:
        """A fence begins (its snapshot taken, its store fence waiting) and stays in flight."""
        index = self.store.hold_next()
        fencing = FenceThread(self.cache, WAIT_S)
        self.fencing.append((fencing, self.store.gate(index), self.model.begin_fence()))

    @precondition(lambda self: bool(getattr(self, "fencing", ())))
    @rule(data=st.data())
    def end_fence(self, data: st.DataObject | int) -> None:
        """One fence in flight ends: it frees what it snapshotted, if still the same entries."""
        n = len(self.fencing)
        index = data if isinstance(data, int) else data.draw(st.integers(0, n - 1))
        fencing, gate, fence = self.fencing.pop(index)
        gate.set()
        assert fencing.join() == self.model.end_fence(fence)

    # -- comparison --
    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        snap = self.cache.snapshot()
        real = {k: self.entry_view(e) for k, e in snap.entries.items()}
        model = {
            k: (
                e.state,
                e.offset,
                e.size,
                sorted(map(str, e.holders)),
                sorted(e.waiters),
                e.doomed,
                e.tainted,
            )
            for k, e in self.model.entries.items()
        }
        assert real == model, (real, model)
        assert snap.eviction_order == self.model.lru
        assert snap.allocator.free_blocks() == self.model.alloc.free_blocks()
        stats, counts = self.cache.stats(), self.model.counts
        assert (stats.hits, stats.evictions, stats.evicted_bytes, stats.inserts) == (
            counts["hits"],
            counts["evictions"],
            counts["evicted_bytes"],
            counts["inserts"],
        )
        assert (stats.loads_ok, stats.loads_failed, stats.loads_unknown) == (
            counts["loads_ok"],
            counts["loads_failed"],
            counts["loads_unknown"],
        )
        assert (stats.publishes_ok, stats.publishes_failed, stats.publishes_unknown) == (
            counts["publishes_ok"],
            counts["publishes_failed"],
            counts["publishes_unknown"],
        )
        assert stats.publishes_started == counts["publishes_started"]
        backlog = self.model.backlog
        if backlog is not None:  # waiting or in flight, dropped, stale, dropped in flight
            real = (stats.publish_backlog, stats.publish_backlog_dropped)
            real += (stats.publish_backlog_stale, self.cache.sizes()["backlog_marks"])
            assert real == (len(backlog), backlog.dropped, backlog.stale, len(backlog.gone))
        for r, rq in self.model.requests.items():  # the request bookkeeping (DESIGN's table)
            rs = snap.requests[r]
            assert (list(rs.holds), rs.waits, rs.reserved) == (rq.holds, rq.waits, rq.reserved)
            assert {k: v.value for k, v in rs.fallbacks.items()} == rq.fallbacks, r
        for r, handle in self.handles.items():
            rq = self.model.requests[r]
            assert handle.fallback_mask().tolist() == self.model.fallback_mask(r)
            reasons = [None if x is None else x.value for x in handle.fallback_reasons()]
            assert reasons == self.model.fallback_reasons(r)
            for (key, shape, dtype, nbytes), view in zip(
                rq.items, handle.embeddings(), strict=False
            ):
                assert (view is None) == (not self.model.serves(r, key, shape, dtype))
                if view is not None:
                    got = view.contiguous().view(torch.uint8).flatten().numpy().tobytes()
                    assert got == payload(key, nbytes), f"{r} read wrong bytes for {key}"

    # -- helpers --
    def item(self, key: str, variant: int) -> Item:
        if key == "big":
            return Item("big", (self.model.capacity + 1,), torch.uint8)
        shape, dtype = ALTERNATE if variant == 5 else CANONICAL[key]
        return Item(key, shape, dtype)

    @staticmethod
    def model_item(it: Item) -> tuple[str, tuple[int, ...], torch.dtype, int]:
        return (it.key, it.shape, it.dtype, it.nbytes)

    @staticmethod
    def entry_view(e: Any) -> tuple[Any, ...]:
        holders = sorted(str(h) for h in e.holders)
        return (e.state.name, e.offset, e.size, holders, sorted(e.waiters), e.doomed, e.tainted)


TestCacheMachine = CacheMachine.TestCase
