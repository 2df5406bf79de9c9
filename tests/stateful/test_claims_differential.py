"""``FleetClaims`` (the real class) against its reference model (``models/claims.py``).

Hypothesis runs random operation sequences on a fleet of 2 or 3 workers and 1 or 2 keys, each
operation on both sides, and after each compares what a user can see: per worker and key the
phase (idle, encoding, waiting, fallen back to its own encode, served, failed, dead), the
encodes per key and which keys the store holds, and that every byte served is the key's.

The real side: each worker is an ``EmbeddingCache``, a ``FleetClaims`` and one request per key,
on the in-process master of ``tests/support/claim_store.py`` (why not a real master: its
docstring; here, a clock the test moves, and hundreds of fleets a run). The master and every
worker's claims read one fake clock; a tick moves it by one second, a lease is ``LEASE`` ticks.
A waiter is a thread in ``FleetClaims.wait``, polling every millisecond of real time; after
each operation the test lets every waiter ask the store twice and every releaser settle.

The mapping (the model's action names in capitals):
- ``request(w, k, then)``: the key stored, the cache loads it (ASK: served). Else ``claim``:
  won (CLAIM, then at once ENCODE: the claimer's look at the store, loaded or encoding), or
  ``then`` is ``fail`` (ENCODEFAILS: ``release``) or ``crash`` (CRASH: the worker stops);
  refused, a waiter (CLAIM: WAITING), whose POLLs run in its thread. A takeover or a fallback
  decides its encode at once (ENCODE).
- ``finish(w, k)``: an encode ends: insert and publish (BEGINPUBLISH, ENDPUBLISH), then
  ``published`` for a claimed key (RELEASE once stored).
- ``tick``: TICK; every waiter polls after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from embcache import EmbeddingCache, Item
from embcache.core.outcomes import Status
from embcache.driver.request import Request
from embcache.pipeline import FleetClaims
from embcache.pipeline import claims as claims_module
from models import claims as model
from tests.support.claim_store import Client, Master

LEASE = 2  # ticks
SHAPE = (2, 8)
SETTLE_S = 10.0  # the longest a real waiter or releaser may take to catch up (a failure)

# The phase a user sees, per model phase.
SEEN = {
    model.IDLE: "idle", model.OWNED: "encoding", model.PUBLISH: "encoding",
    model.WAITING: "waiting", model.FALLBACK: "encoding", model.DONE: "served",
    model.FAILED: "failed", model.DEAD: "dead",
}  # fmt: skip


def value(key: str) -> torch.Tensor:
    return torch.full(SHAPE, float(sum(key.encode()) % 89))


class Clock:
    """The fake clock the master and the claims read (seconds; a tick is one)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Events:
    """A trace sink that counts each key's events and lets a test wait for more of them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()

    def append(self, event: dict[str, Any], /) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def count(self, key: str, action: str | None = None) -> int:
        with self._changed:
            return sum(e["key"] == key and action in (None, e["action"]) for e in self.events)

    def wait_for(self, ready: Callable[[], bool]) -> None:
        with self._changed:
            assert self._changed.wait_for(ready, timeout=SETTLE_S), "the real side is stuck"


class RealWorker:
    """One worker: its cache, claims and, per key, its request and what it is doing."""

    def __init__(self, master: Master, clock: Clock, name: str) -> None:
        self.store = Client(master, name)
        self.cache = EmbeddingCache(1 << 14, store=self.store, pin_memory=False)
        self.log = Events()
        self.claims = FleetClaims(self.store, poll_s=0.001, clock=clock, trace=self.log)
        self.name = name
        self.requests: dict[str, Request] = {}
        self.seen: dict[str, str] = {}
        self.claimed: set[str] = set()  # keys this worker encodes under its claim
        self.threads: dict[str, threading.Thread] = {}

    def close(self) -> None:
        for thread in self.threads.values():
            thread.join(SETTLE_S)
        for request in self.requests.values():
            request.close()
        self.claims.close()
        self.cache.close()


class ClaimsDifferential(RuleBasedStateMachine):
    """Real fleet and model fleet, operation by operation."""

    @initialize(workers=st.integers(2, 3), keys=st.integers(1, 2))
    def setup(self, workers: int, keys: int) -> None:
        self.names = [f"w{n}" for n in range(workers)]
        self.keys = [f"k{n}" for n in range(keys)]
        self.model = model.Fleet(
            self.names, self.keys, LEASE, frozenset({model.CRASH, model.SLOW, model.FAIL})
        )
        self.clock = Clock()
        self.master = Master(float(LEASE), clock=self.clock)
        self.real = {w: RealWorker(self.master, self.clock, w) for w in self.names}
        self.encodes = dict.fromkeys(self.keys, 0)

    def teardown(self) -> None:
        if not hasattr(self, "real"):
            return
        threads = [t for worker in self.real.values() for t in worker.threads.values()]
        deadline = time.monotonic() + SETTLE_S
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            self.clock.now += LEASE  # every wait ends within two leases
            time.sleep(0.005)
        for worker in self.real.values():
            worker.close()

    # -------------------------------------------------------------- operations

    def phase(self, w: str, k: str) -> str:
        return self.real[w].seen.get(k, "idle")

    @rule(pick=st.integers(0, 5), then=st.sampled_from(["encode", "encode", "fail", "crash"]))
    def request(self, pick: int, then: str) -> None:
        alive = [w for w in self.names if "dead" not in self.real[w].seen.values()]
        idle = [(w, k) for w in alive for k in self.keys if self.phase(w, k) == "idle"]
        if not idle:
            return
        w, k = idle[pick % len(idle)]  # (drawn alike whatever the real side's races did)
        if then == "crash" and any(
            self.phase(w, j) in ("waiting", "encoding") for j in self.keys
        ):
            then = "encode"  # (a waiter's thread cannot be stopped: crash only a claimer)
        self.real_request(w, k, then)
        self.model_request(w, k, then)
        self.settle()

    @rule(pick=st.integers(0, 5))
    def finish(self, pick: int) -> None:
        busy = [(w, k) for w in self.names for k in self.keys if self.phase(w, k) == "encoding"]
        if not busy:
            return
        w, k = busy[pick % len(busy)]
        worker = self.real[w]
        request = worker.requests[k]
        request.insert([k], [value(k)], publish=True)
        deadline = time.monotonic() + SETTLE_S
        while not self.master.objects.get(k):
            assert time.monotonic() < deadline, f"{k} never stored"
            time.sleep(0.001)  # the cache's put runs on its I/O pool
        if k in worker.claimed:
            released = worker.log.count(k, "Release")
            worker.claims.published([k])
            worker.log.wait_for(lambda: worker.log.count(k, "Release") > released)
        worker.seen[k] = "served"
        assert self.model.begin_publish(w, k), (w, k)
        if self.model.ws[w, k].phase == model.PUBLISHING:
            assert self.model.end_publish(w, k), (w, k)
        self.settle()

    @rule()
    def tick(self) -> None:
        self.clock.now += 1.0
        self.model.tick()  # (not taken when nothing counts down: time passes all the same)
        self.settle()

    # -------------------------------------------------------------- the real side

    def real_request(self, w: str, k: str, then: str) -> None:
        worker = self.real[w]
        item = Item(k, SHAPE, torch.float32)
        request, [status] = worker.cache.lookup(f"{w}-{k}", [item], reserve_misses=True)
        worker.requests[k] = request
        if status.status is Status.LOADING:  # stored: the cache loads it
            assert request.wait(SETTLE_S)
            self.served(w, k)
            return
        assert status.status is Status.RESERVED, status
        mine, waiting = worker.claims.claim([k])
        if mine and then == "fail":
            worker.claims.release(mine)
            worker.seen[k] = "failed"
        elif mine and then == "crash":
            for j in self.keys:
                if worker.seen.get(j) not in ("served", "failed"):
                    worker.seen[j] = "dead"
        elif mine:
            worker.claimed.add(k)
            self.start_encode(w, k)
        elif waiting:
            worker.seen[k] = "waiting"
            thread = threading.Thread(target=self.real_wait, args=(w, k, request, item))
            worker.threads[k] = thread
            thread.start()
        else:
            raise AssertionError(f"no claim answer for {k} at {w}")

    def real_wait(self, w: str, k: str, request: Request, item: Item) -> None:
        worker = self.real[w]
        settled = worker.claims.wait(request, [item])
        if settled.loaded:
            self.served(w, k)
        elif settled.mine:
            worker.claimed.add(k)
            self.start_encode(w, k)
        else:
            self.start_encode(w, k)  # (its wait ended: encoded here, no claim)

    def start_encode(self, w: str, k: str) -> None:
        self.encodes[k] += 1
        self.real[w].seen[k] = "encoding"

    def served(self, w: str, k: str) -> None:
        [view] = self.real[w].requests[k].embeddings()
        assert view is not None and torch.equal(view, value(k)), f"wrong bytes for {k} at {w}"
        self.real[w].seen[k] = "served"

    def settle(self) -> None:
        """Let every waiter ask the store twice (a full poll after the operation) or end, and
        every releaser release what is due."""
        for worker in self.real.values():
            for k, thread in list(worker.threads.items()):
                seen = worker.log.count(k)
                worker.log.wait_for(
                    lambda: not thread.is_alive() or worker.log.count(k) >= seen + 2  # noqa: B023
                )
                if not thread.is_alive():
                    thread.join()
                    del worker.threads[k]

    # -------------------------------------------------------------- the model side

    def model_request(self, w: str, k: str, then: str) -> None:
        fleet = self.model
        assert fleet.ask(w, k)
        if fleet.ws[w, k].phase == model.CLAIMING:
            assert fleet.claim_key(w, k)
            if fleet.ws[w, k].phase == model.OWNED and not fleet.complete(k):
                if then == "fail":
                    assert fleet.encode_fails(w, k)
                elif then == "crash":
                    assert fleet.crash(w)
        self.model_settle()

    def model_settle(self) -> None:
        """The steps the real side takes on its own: polls, the look and encode decisions,
        releases."""
        fleet = self.model
        changed = True
        while changed:
            changed = False
            for k in self.keys:
                holder = self.master.claims.get(k, ("", 0.0))[0]
                for w in sorted(self.names, key=lambda w: w != holder):
                    # (the real claim's holder first: of waiters racing for a takeover, the
                    # model's winner is the real one)
                    phase = fleet.ws[w, k].phase
                    if phase == model.WAITING:  # (the real poll asks the store as it is now)
                        changed |= fleet.poll(w, k, "stored" if fleet.complete(k) else "missed")
                    elif phase in (model.OWNED, model.FALLBACK):
                        changed |= fleet.encode(w, k)
                    elif phase == model.RELEASE:
                        changed |= fleet.release(w, k)

    # -------------------------------------------------------------- what a user sees

    @invariant()
    def same_outcomes(self) -> None:
        if not hasattr(self, "real"):
            return
        self.model_settle()
        fleet = self.model
        model_seen = {(w, k): SEEN[fleet.ws[w, k].phase] for w in self.names for k in self.keys}
        real_seen = {(w, k): self.phase(w, k) for w in self.names for k in self.keys}
        assert real_seen == model_seen, (real_seen, model_seen)
        assert self.encodes == fleet.encodes, (self.encodes, fleet.encodes)
        stored = {k for k in self.keys if k in self.master.objects}
        assert stored == {k for k in self.keys if fleet.complete(k)}


# Each example runs real threads that poll in real time (about 0.1 s an example): at most 300
# examples (the ci profile's 1,000 took 133 s of wall time, 14 s of CPU, on 2 loaded cores).
ClaimsDifferential.TestCase.settings = settings(
    ClaimsDifferential.TestCase.settings, max_examples=min(settings().max_examples, 300)
)
TestClaimsDifferential = ClaimsDifferential.TestCase


def test_a_waiter_that_gives_up_after_one_claim_differs_from_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planted bug: a waiter waits on one claim only (``CLAIMS_WAITED`` 1), so it encodes
    while a newer claim (a takeover by another waiter) is live. The differential test sees it:
    the model waits one more lease."""
    monkeypatch.setattr(claims_module, "CLAIMS_WAITED", 1)
    machine = ClaimsDifferential()
    try:
        machine.setup(workers=3, keys=1)
        machine.real_request("w0", "k0", "crash")  # w0 claims, and dies
        machine.model_request("w0", "k0", "crash")
        machine.settle()
        for w in ("w1", "w2"):
            machine.real_request(w, "k0", "encode")  # both wait on w0's claim
            machine.model_request(w, "k0", "encode")
            machine.settle()
        machine.same_outcomes()
        machine.tick()
        machine.same_outcomes()
        with pytest.raises(AssertionError, match="encoding"):
            machine.tick()  # w0's lease ends: one waiter takes over, the other ...
            machine.same_outcomes()
    finally:
        machine.teardown()
