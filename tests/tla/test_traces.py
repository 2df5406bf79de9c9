"""Trace validation: runs of the real cache are behaviours of the TLA+ spec.

The TLC runs (``-m tla``) need Java: at least 200 traces of the Hypothesis state machine and of
threaded runs against a faulty store must all be accepted, and a cache with one real bug
monkeypatched in must produce a trace that is rejected at the buggy event. The conversion tests
at the end need neither Java nor TLC.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from embcache import EmbeddingCache, Item, TransferOutcome
from embcache.core import entry_actions, publishing
from embcache.core.build import loaded_build
from embcache.core.lifecycle import ABSENT, QUARANTINED, READY
from embcache.core.policy import LruPolicy, Policy
from embcache.core.recency import RecencyOrder
from embcache.core.state import CoreState
from embcache.driver.trace import TraceLog
from embcache.testing import Fault, FaultInjectingStore
from tests.tla.tla_modules import load_trace

ROOT = Path(__file__).resolve().parents[2]

TLA = Path(__file__).resolve().parents[2] / "tla"
ALIGN = 256


trace_mod = load_trace()


# ------------------------------------------------------------------ all traces accepted


@pytest.mark.tla
@pytest.mark.timeout(600)
def test_generated_traces_are_behaviours_of_the_spec(tmp_path: Path) -> None:
    from tests import tracegen

    paths = tracegen.write(tracegen.machine_traces(150), tmp_path, "machine")
    paths += tracegen.write([tracegen.threaded_trace(s) for s in range(50)], tmp_path, "threaded")
    paths += tracegen.write(tracegen.overlapping_fence_traces(), tmp_path, "overlapping")
    assert len(paths) >= 200
    verdicts = trace_mod.validate(paths)
    rejected = [v.describe() for v in verdicts if not v.accepted]
    assert not rejected, "\n".join(rejected)
    assert len(verdicts) == len(paths)
    assert sum(v.events for v in verdicts) > 20_000  # the threaded traces are long


# ------------------------------------------------------------------ teeth: one bug each


def item(key: str, units: int = 1) -> Item:
    return Item(key, (units * ALIGN // 4,), torch.float32)


def tensor(it: Item) -> torch.Tensor:
    return torch.zeros(it.shape, dtype=it.dtype)


class Undrained(ThreadPoolExecutor):
    """The I/O pool of a buggy cache, which may be inconsistent: ``close()`` does not drain it."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)


@pytest.fixture
def traced() -> Iterator[Callable[..., tuple[EmbeddingCache, TraceLog]]]:
    caches: list[EmbeddingCache] = []

    def make(
        units: int,
        store: FaultInjectingStore | None = None,
        *,
        policy: Policy | str = "lru",
        log: TraceLog | None = None,
    ) -> tuple[EmbeddingCache, TraceLog]:
        log = TraceLog() if log is None else log
        cache = EmbeddingCache(
            units * ALIGN, store=store, alignment=ALIGN, max_eviction_batch=2,
            pin_memory=False, trace=log, policy=policy, io_executor=Undrained(1),
        )  # fmt: skip
        caches.append(cache)
        return cache, log

    yield make
    for cache in caches:
        cache.close()  # takes nothing new, and leaves the transfers in flight undrained


def rejected_at(log: TraceLog) -> Any:
    [verdict] = trace_mod.validate(traces=[("buggy", list(log.events))], workers=1)
    assert not verdict.accepted, "the spec accepted the trace of a buggy cache"
    return verdict


def first(log: TraceLog, **fields: Any) -> dict[str, Any]:
    return next(e for e in log.events if all(e.get(k) == v for k, v in fields.items()))


def wait_for(log: TraceLog, **fields: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(all(e.get(k) == v for k, v in fields.items()) for e in list(log.events)):
            return first(log, **fields)
        time.sleep(0.01)
    raise AssertionError(f"no event {fields} in the trace")


def planted_on_the_pure_core(request: pytest.FixtureRequest) -> bool:
    """Whether this test, which plants a bug into a core class, ran (and passed) in a child
    process on the pure core instead: the compiled core's classes can be neither patched
    (compiled callers call the compiled method) nor extended, so there the plant would not
    take. On the pure core: False, and the test runs here."""
    if loaded_build() != "compiled":
        return False
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=ROOT, env={**os.environ, "EMBCACHE_PURE": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:]
    return True


@pytest.mark.tla
@pytest.mark.timeout(120)
def test_evicting_a_pinned_entry_is_rejected_at_the_evict(
    traced: Callable[..., tuple[EmbeddingCache, TraceLog]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    if planted_on_the_pure_core(request):
        return
    # The bug: a new pin leaves the entry in the LRU, and eviction does not check pins. A pin
    # takes the entry out of the order (``discard``) once its holder is set, wherever it pins:
    # the planted order (the policy's, a public seam) keeps it when its entry is pinned READY.
    class PinBlindOrder(RecencyOrder):
        entries: ClassVar[Mapping[str, Any]] = {}

        def discard(self, key: str) -> bool:
            entry = self.entries.get(key)
            if entry is not None and entry.state is READY and entry.holders:
                return False  # the bug: still evictable
            return super().discard(key)

    class PinBlindPolicy(LruPolicy):
        def order(self) -> RecencyOrder:
            return PinBlindOrder()

    free = entry_actions.free

    def evict(st: CoreState, entry: Any, *, keep_range: bool = False) -> None:
        entry.state = ABSENT
        free(st, entry, keep_range=keep_range)
        st.emit("Evict", None, entry.key, entry)

    monkeypatch.setattr(entry_actions, "evict", evict)
    cache, log = traced(1, policy=PinBlindPolicy())
    PinBlindOrder.entries = cache.runner.core.queries.entries  # the live entries, read-only
    a, b = item("a"), item("b")
    with cache.request("r1") as r1:
        r1.insert(["a"], [tensor(a)], publish=False)
    r2 = cache.request("r2")
    r2.lookup([a])  # a hit: "a" is pinned by r2 (and, by the bug, still in the LRU)
    r3 = cache.request("r3")
    r3.insert(["b"], [tensor(b)], publish=False)  # evicts the pinned "a"
    verdict = rejected_at(log)
    assert verdict.seq == first(log, action="Evict", key="a")["seq"], verdict.describe()
    assert verdict.why == "ActionEnabled", verdict.describe()  # "a" is pinned: not in the LRU


@pytest.mark.tla
@pytest.mark.timeout(120)
def test_freeing_on_an_unknown_load_is_rejected_at_the_end_load(
    traced: Callable[..., tuple[EmbeddingCache, TraceLog]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    if planted_on_the_pure_core(request):
        return
    # The bug: EndLoad(UNKNOWN) frees the range as if FAILED (the write may still land).
    original = entry_actions.end_load
    unknown = TransferOutcome.UNKNOWN

    def end_load(st: CoreState, entry: Any, outcome: Any, reason: Any) -> Any:
        if outcome is not unknown:
            return original(st, entry, outcome, reason)
        emit = st.emit

        def emit_unknown(action: str, *args: Any, **kwargs: Any) -> None:
            emit(action, *args, **{**kwargs, "outcome": unknown.name})

        st.emit = emit_unknown  # type: ignore[method-assign]
        try:
            return original(st, entry, TransferOutcome.FAILED, reason)
        finally:
            del st.emit

    monkeypatch.setattr(entry_actions, "end_load", end_load)  # (a store read's EndLoad)
    store = FaultInjectingStore(delay_seconds=0.0)
    x = item("x")
    store.put_object("x", bytes(x.nbytes))
    store.inject("x", Fault.UNKNOWN)
    cache, log = traced(2, store)
    with cache.request("r1") as r1:
        r1.lookup([x])
        assert r1.wait(timeout=10)
    event = first(log, action="EndLoad", key="x")
    assert event["outcome"] == "UNKNOWN" and event["state"] == "ABSENT"
    verdict = rejected_at(log)
    assert verdict.seq == event["seq"], verdict.describe()
    assert verdict.why == "EventExplained", verdict.describe()  # QUARANTINED, not ABSENT


@pytest.mark.tla
@pytest.mark.timeout(120)
def test_a_fence_freeing_by_key_is_rejected_at_that_fence(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if planted_on_the_pure_core(request):
        return
    # The bug: the fence frees the keys of its snapshot that are QUARANTINED when it
    # ends, so an overlapping fence frees a key QUARANTINED again after it began.
    from tests import tracegen

    def fence_by_key(st: CoreState, snap: Any) -> int:
        freed = []
        for old in snap.entries:
            entry = st.entries.get(old.key)
            if entry is not None and entry.state is QUARANTINED:
                entry.state = ABSENT
                entry_actions.free(st, entry)
                freed.append(entry.key)
        st.emit("Fence", None, None, None, fence=snap.fence, keys=freed)
        return len(freed)

    monkeypatch.setattr(publishing, "fence", fence_by_key)
    for events in tracegen.overlapping_fence_traces():
        [verdict] = trace_mod.validate(traces=[("buggy", events)], workers=1)
        assert not verdict.accepted, "the spec accepted a fence that freed by key"
        ends = [e for e in events if e["action"] == "Fence" and e["keys"] == ["k"]]
        assert verdict.seq == ends[1]["seq"], verdict.describe()  # the second fence freeing k
        assert verdict.why == "ActionMatches", verdict.describe()  # it may free nothing


@pytest.mark.tla
@pytest.mark.timeout(120)
def test_skipping_the_waiter_hand_off_is_rejected_at_the_end_load(
    traced: Callable[..., tuple[EmbeddingCache, TraceLog]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    if planted_on_the_pure_core(request):
        return
    # The bug: EndLoad(OK) makes the entry READY but does not pin its waiters (they are
    # dropped), so it is evictable before they read it.
    original = entry_actions.end_load
    ok = TransferOutcome.OK

    def end_load(st: CoreState, entry: Any, outcome: Any, reason: Any) -> Any:
        if outcome is ok and not entry.doomed:
            for r in entry.waiters:
                st.requests[r].waits.discard(entry.key)
            entry.waiters = frozenset()
        return original(st, entry, outcome, reason)

    monkeypatch.setattr(entry_actions, "end_load", end_load)  # (a store read's EndLoad)
    store = FaultInjectingStore(delay_seconds=0.0)
    x = item("x")
    store.put_object("x", bytes(x.nbytes))
    cache, log = traced(2, store)
    with cache.request("r1") as r1:
        r1.lookup([x])
        r1.wait(timeout=0.2)  # the bug forgets to wake r1 too
        event = wait_for(log, action="EndLoad", key="x")
    assert event["outcome"] == "OK" and event["holders"] == []
    verdict = rejected_at(log)
    assert verdict.seq == event["seq"], verdict.describe()
    assert verdict.why == "EventExplained", verdict.describe()  # holders {r1}, not {}


# ------------------------------------------------------------------ conversion (no TLC)


def test_conversion_maps_requests_to_slots_and_bytes_to_units() -> None:
    events: list[dict[str, Any]] = [
        {"seq": 1, "action": "Init", "capacity": 1024, "alignment": 256,
         "max_eviction_batch": 2, "enable_eviction": True, "request": None, "key": None},
        {"seq": 2, "action": "OpenRequest", "request": "a", "key": None, "outcome": None},
        {"seq": 3, "action": "OpenRequest", "request": "b", "key": None, "outcome": None},
        {"seq": 4, "action": "CloseRequest", "request": "a", "key": None, "outcome": None},
        {"seq": 5, "action": "OpenRequest", "request": "c", "key": None, "outcome": None},
        {"seq": 6, "action": "Evict", "request": None, "key": "k1", "outcome": None,
         "size": 256, "offset": 512, "state": "ABSENT", "holders": [], "waiters": [],
         "doomed": False, "tainted": False},
        {"seq": 7, "action": "BeginLoad", "request": "c", "key": "k2", "outcome": "OK",
         "size": 512, "offset": 512, "state": "LOADING", "holders": [], "waiters": ["c"],
         "doomed": False, "tainted": False},
        {"seq": 8, "action": "BeginLoad", "request": "b", "key": "k3", "outcome": "NO_SPACE",
         "size": 300},
    ]  # fmt: skip
    converted = trace_mod.convert(events, "t")
    assert (converted.units, converted.batch, converted.slots) == (4, 2, 2)
    slots = [e["r"] for e in converted.events[:4]]
    assert slots == [1, 2, 1, 1]  # "c" reuses the slot "a" gave back
    load = converted.events[5]
    assert (load["n"], load["o"], load["V"], load["w"]) == (2, 2, {"k1"}, {1})
    assert converted.events[6]["n"] == 2  # 300 bytes ask for two units
    text, order = trace_mod.module_text("M", [converted])
    assert order == [(4, 2)] and "INSTANCE TraceEmbeddingCache" in text


def test_an_evict_without_its_begin_load_is_not_explained() -> None:
    events: list[dict[str, Any]] = [
        {"seq": 1, "action": "Init", "capacity": 512, "alignment": 256,
         "max_eviction_batch": 1, "enable_eviction": True},
        {"seq": 2, "action": "Evict", "request": None, "key": "k", "size": 256, "offset": 0,
         "state": "ABSENT", "holders": [], "waiters": [], "doomed": False, "tainted": False},
        {"seq": 3, "action": "BeginFence", "request": None, "key": None, "fence": 1, "keys": []},
        {"seq": 4, "action": "Fence", "request": None, "key": None, "fence": 1, "keys": []},
    ]  # fmt: skip
    converted = trace_mod.convert(events, "t")
    assert [e["a"] for e in converted.events] == ["EvictWithoutBeginLoad", "BeginFence", "Fence"]


def test_overlapping_fences_map_to_fence_slots() -> None:
    init = {"seq": 1, "action": "Init", "capacity": 512, "alignment": 256,
            "max_eviction_batch": 1, "enable_eviction": True}  # fmt: skip

    def fence(seq: int, action: str, fence_id: int, keys: list[str]) -> dict[str, Any]:
        return {"seq": seq, "action": action, "request": None, "key": None, "fence": fence_id,
                "keys": keys}  # fmt: skip

    events = [init, fence(2, "BeginFence", 7, ["k"]), fence(3, "BeginFence", 8, ["k"]),
              fence(4, "Fence", 7, ["k"]), fence(5, "BeginFence", 9, []),
              fence(6, "Fence", 8, []), fence(7, "Fence", 9, [])]  # fmt: skip
    converted = trace_mod.convert(events, "t")
    assert [e["f"] for e in converted.events] == [1, 2, 1, 1, 2, 1]  # 9 reuses 7's slot
    assert converted.fences == 2 and converted.events[0]["Q"] == {"k"}
    text, _ = trace_mod.module_text("M", [converted])
    assert "Fences <- 1..2" in text
    old = {"seq": 2, "action": "Fence", "request": None, "key": None, "keys": []}
    with pytest.raises(trace_mod.TraceError, match="without its fence id"):
        trace_mod.convert([init, old], "t")


def test_a_publish_pin_keeps_the_slot_of_its_closed_request() -> None:
    entry = {"size": 256, "offset": 0, "state": "READY", "waiters": [], "doomed": False,
             "tainted": False}  # fmt: skip
    events: list[dict[str, Any]] = [
        {"seq": 1, "action": "Init", "capacity": 512, "alignment": 256,
         "max_eviction_batch": 1, "enable_eviction": True},
        {"seq": 2, "action": "OpenRequest", "request": "a", "key": None},
        {"seq": 3, "action": "Publish", "request": "a", "key": "k", **entry,
         "holders": ["a", "publish:a"]},
        {"seq": 4, "action": "Release", "request": "a", "key": "k", **entry,
         "holders": ["publish:a"]},
        {"seq": 5, "action": "CloseRequest", "request": "a", "key": None},
        {"seq": 6, "action": "OpenRequest", "request": "b", "key": None},
        {"seq": 7, "action": "EndPublish", "request": "a", "key": "k", "outcome": "OK",
         **entry, "holders": []},
    ]  # fmt: skip
    converted = trace_mod.convert(events, "t")
    publish, release, end = converted.events[1], converted.events[2], converted.events[5]
    assert (publish["h"], publish["p"]) == ({1}, 1)
    assert (release["h"], release["p"]) == (set(), 1)
    assert (end["r"], end["p"]) == (1, trace_mod.NO_REQUEST)


@pytest.mark.tla
@pytest.mark.timeout(120)
def test_a_miss_with_the_wrong_reason_is_rejected_at_the_lookup(
    traced: Callable[..., tuple[EmbeddingCache, TraceLog]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bug: a lookup of a doomed (busy) entry reports it as not found. Planted where the
    # events leave the cache (its trace sink), so the trace is the one such a cache writes.
    class Misreporting(TraceLog):
        def append(self, event: dict[str, Any], /) -> None:
            if event["action"] == "Lookup" and event.get("reason") == "busy":
                event = {**event, "reason": "not_found"}
            super().append(event)

    cache, log = traced(2, log=Misreporting())
    a = item("a")
    with cache.request("r1") as r1:
        r1.insert(["a"], [tensor(a)], publish=False)
        cache.remove("a")  # held by r1: doomed
        with cache.request("r2") as r2:
            r2.lookup([a])  # a miss: busy, reported as not_found
    verdict = rejected_at(log)
    assert verdict.seq == first(log, action="Lookup", request="r2")["seq"], verdict.describe()
