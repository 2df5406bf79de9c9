"""Trace validation of fleet claims: a worker's ``FleetClaims`` events are behaviours of
``tla/FleetClaims.tla`` (``tla/claims_trace.py``, ``tla/TraceFleetClaims.tla``).

Fleets of encode workers (threads, each its own cache, ``EncodePipeline`` and ``FleetClaims``)
run on the in-process master of ``tests/support/claim_store.py`` (why not a real one: its
docstring), every worker's trace is recorded and each must be accepted; a worker with one of
two planted bugs, run where the bug shows, records a trace that is rejected at the event the
bug made: a wait that goes on past the lease of the claim it waits on, and a waiter that gives
up and encodes while that claim is live. Each planted run is checked against the same run
without the bug, which is accepted. TLC (``-m tla``) needs Java.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.driver.global_store import CLAIM_TAKEN
from embcache.driver.trace import TraceLog
from embcache.pipeline import FleetClaims
from embcache.pipeline import claims as claims_module
from tests.support.claim_store import Client, Master
from tests.support.helpers import AdmitsNothing
from tests.tla.tla_modules import load_claims_trace

if TYPE_CHECKING:
    from embcache.store.mooncake_master import MooncakeMaster

pytestmark = [pytest.mark.tla, pytest.mark.timeout(180)]

SHAPE = (4, 16)
LEASE_S = 1.0  # half a lease a tick: a poll every 5 ms is in every tick, even on a loaded machine
trace_mod = load_claims_trace()


def item(key: str) -> Item:
    return Item(key, SHAPE, torch.float32)


class SleepyEncoder:
    """Takes ``encode_s`` per call, no CPU; the output is a function of the key."""

    device = torch.device("cpu")

    def __init__(self, encode_s: float, fail: Callable[[], bool] = lambda: False) -> None:
        self.encode_s = encode_s
        self.fail = fail

    def __call__(self, inputs: Sequence[Any], /) -> list[torch.Tensor]:
        time.sleep(self.encode_s)
        if self.fail():
            raise RuntimeError("planted encoder failure")
        return [torch.full(SHAPE, float(sum(str(k).encode()) % 97)) for k in inputs]



class Worker:
    """One encode worker: a client of the master, its cache, claims (traced) and pipeline.
    ``refusing``: a pool of one entry that admits nothing that must evict (every key after the
    first is a miss the pool refused: claimed, published and loaded as copies)."""

    def __init__(
        self, master: Master, name: str, encoder: SleepyEncoder, store: type[Client],
        refusing: bool = False, **options: Any,
    ) -> None:  # fmt: skip
        self.name = name
        self.log = TraceLog()
        self.store = store(master, name)
        policy: Any = AdmitsNothing() if refusing else "adaptive-work"
        self.cache = EmbeddingCache(256 if refusing else 1 << 16, store=self.store,
                                    pin_memory=False, policy=policy)  # fmt: skip
        self.claims = FleetClaims(self.store, trace=self.log, **options)
        self.pipeline = EncodePipeline(self.cache, encoder, claims=self.claims)

    def serve(self, requests: list[list[str]]) -> None:
        for n, keys in enumerate(requests):
            items = [item(k) for k in keys]
            try:
                out = self.pipeline.encode(f"{self.name}-{n}", items, keys)
            except RuntimeError:
                continue  # the planted encoder failure: the request fails, the claims end
            want = torch.cat([torch.full(SHAPE, float(sum(k.encode()) % 97)) for k in keys])
            assert torch.equal(out, want), f"{self.name}: wrong bytes for {keys}"

    def close(self) -> None:
        self.claims.close()
        self.cache.close()


@pytest.fixture
def fleet() -> Iterator[Callable[..., list[Worker]]]:
    made: list[Worker] = []

    def run(
        master: Master, plans: list[list[list[str]]], *, encode_s: float = 0.05,
        store: type[Client] = Client, fail: Callable[[], bool] = lambda: False,
        refusing: bool = False, **options: Any,
    ) -> list[Worker]:  # fmt: skip
        workers = [
            Worker(master, f"w{n}", SleepyEncoder(encode_s, fail), store, refusing, **options)
            for n in range(len(plans))
        ]
        made.extend(workers)
        threads = [
            threading.Thread(target=w.serve, args=(p,)) for w, p in zip(workers, plans, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        deadline = time.monotonic() + 3 * master.lease_s  # the workers' claims released
        names = {w.name for w in workers}
        while time.monotonic() < deadline and any(
            owner in names for owner, _ in list(master.claims.values())
        ):
            time.sleep(0.01)
        return workers

    yield run
    for worker in made:
        worker.close()


def verdicts(workers: list[Worker], fleet_size: int) -> list[Any]:
    traces = [(w.name, list(w.log.events)) for w in workers]
    return list(trace_mod.validate(traces, workers=fleet_size))


def dead_claim(master: Master, key: str) -> float:
    """A claimer that claims ``key`` and dies (never encodes, never releases); when it did."""
    assert Client(master, "dead").claim([key]) == [0]
    return master.claims[key][1]


# ------------------------------------------------------------------ accepted


def test_fleets_record_traces_the_spec_explains(fleet: Callable[..., list[Worker]]) -> None:
    rng = random.Random(55)
    keys = [f"k{n}" for n in range(5)]
    runs: list[tuple[list[Worker], int]] = []
    # Two workers given the same new images at once: one encodes, the other loads.
    runs.append((fleet(Master(LEASE_S), [[["a", "b"]], [["a", "b"]]]), 2))
    # Three workers, random overlapping requests.
    plans = [[rng.sample(keys, rng.randint(1, 3)) for _ in range(4)] for _ in range(3)]
    runs.append((fleet(Master(LEASE_S), plans), 3))
    # A claimer died: the waiter takes the claim over at its lease end and encodes.
    master = Master(LEASE_S)
    dead_claim(master, "x")
    runs.append((fleet(master, [[["x", "y"]]]), 2))
    # Encodes fail now and then: the claim is released at once and another takes it over.
    flaky = random.Random(7)
    runs.append((fleet(Master(LEASE_S), [[["f"]], [["f"]], [["f"]]],
                       fail=lambda: flaky.random() < 0.5), 3))  # fmt: skip
    # Pools that refuse every key but their first: claimed all the same, published as copies.
    refused = fleet(Master(LEASE_S), [[["p"], ["q", "r"]], [["s"], ["q", "r"]]], refusing=True)
    runs.append((refused, 2))
    checked = []
    for workers, size in runs:
        checked += verdicts(workers, size)
    rejected = [v.describe() for v in checked if not v.accepted]
    assert not rejected, "\n".join(rejected)
    outcomes = {
        (e["action"], e["outcome"]) for workers, _ in runs for w in workers for e in w.log.events
    }
    for seen in [("Claim", "won"), ("Claim", "taken"), ("Poll", "won"), ("Release", "stored"),
                 ("Encode", "encoded")]:  # fmt: skip
        assert seen in outcomes, f"no {seen} in the fleets' traces: {sorted(outcomes)}"
    assert ("Poll", "loaded") in outcomes or ("Ask", "hit") in outcomes
    assert sum(w.claims.stats().copied for w in refused) == 2, "q and r, published as copies"
    assert sum(w.claims.stats().read_copies for w in refused) == 2, "and read as copies"


@pytest.mark.mooncake
def test_a_fleet_on_a_real_master_records_traces_the_spec_explains(
    mooncake_master: MooncakeMaster, key_prefix: str
) -> None:
    """Two workers on a real ``mooncake_master`` given the same new images at once (claims
    with the store's lease: the master's ``--put_start_discard_timeout_sec``)."""
    from embcache.store.mooncake import MooncakeStore

    workers = []
    for n, segment in enumerate((64 << 20, 0)):
        store = MooncakeStore(
            **mooncake_master.store_kwargs(), key_prefix=key_prefix, global_segment_size=segment
        )
        store.connect()
        log = TraceLog()
        cache = EmbeddingCache(4 << 20, store=store, pin_memory=False)
        claims = FleetClaims(store, trace=log)
        workers.append((f"w{n}", store, cache, claims, log,
                        EncodePipeline(cache, SleepyEncoder(0.2), claims=claims)))  # fmt: skip
    keys = ["a", "b", "c"]
    try:
        threads = [
            threading.Thread(target=pipeline.encode, args=(name, [item(k) for k in keys], keys))
            for name, *_, pipeline in workers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for _, _, _, claims, log, _ in workers:
            deadline = time.monotonic() + 10  # the claimer's releases, once its publish is seen
            while claims.stats().claimed + claims.stats().taken_over > sum(
                e["action"] in ("Release", "EncodeFails") for e in list(log.events)
            ):
                assert time.monotonic() < deadline, log.events
                time.sleep(0.01)
    finally:
        for _, store, cache, claims, _, _ in reversed(workers):
            claims.close()
            cache.close()
            store.close()
    traces = [(name, list(log.events)) for name, _, _, _, log, _ in workers]
    checked = trace_mod.validate(traces, workers=2)
    rejected = [v.describe() for v in checked if not v.accepted]
    assert not rejected, "\n".join(rejected)
    assert len(checked) == 6
    actions = {(e["action"], e["outcome"]) for _, events in traces for e in events}
    assert ("Claim", "won") in actions and ("Release", "stored") in actions, actions
    assert ("Ask", "hit") in actions or ("Poll", "loaded") in actions, actions  # one waited


@pytest.mark.mooncake
def test_a_publish_and_release_between_a_polls_ask_and_its_claim_is_explained(
    mooncake_master: MooncakeMaster, key_prefix: str
) -> None:
    """A waiter's poll asks whether the key is stored, then claims it: two calls. The claimer's
    publish and release landing between them (made to happen here: the waiter's first poll
    claims only once the claimer's encode, held until then, is published and released) give
    the waiter a claim on a key stored by then: its second look loads it (``Encode`` ``loaded``,
    ``Release`` ``late``), no encode. The spec explains it (``FleetClaims.tla``'s ``Looks``)."""
    from embcache.store.mooncake import MooncakeStore

    keys = ["a", "b", "c"]
    go = threading.Event()  # the claimer's encoder runs once the waiter's poll has asked

    class HeldEncoder(SleepyEncoder):
        def __call__(self, inputs: Sequence[Any], /) -> list[torch.Tensor]:
            assert go.wait(30), "the waiter never polled"
            return super().__call__(inputs)

    class ClaimsAfterTheRelease(MooncakeStore):
        """The waiter's client of the real master: its third claim call (the first poll's,
        after ``FleetClaims.claim``'s and the wait's first ask's) is made once the claimer's
        claims are released, its publish visible."""

        calls = 0

        def claim(self, keys: Sequence[str]) -> list[int]:
            self.calls += 1
            if self.calls == 3:
                go.set()
                deadline = time.monotonic() + 30
                while claimer.stats().released < len(keys):
                    assert time.monotonic() < deadline, "the claimer never released"
                    time.sleep(0.005)
            return super().claim(keys)

    made = []
    try:
        for segment, store_type, encoder in (
            (64 << 20, MooncakeStore, HeldEncoder(0.0)),
            (0, ClaimsAfterTheRelease, SleepyEncoder(0.0)),
        ):
            store = store_type(**mooncake_master.store_kwargs(), key_prefix=key_prefix,
                               global_segment_size=segment)  # fmt: skip
            store.connect()
            log = TraceLog()
            cache = EmbeddingCache(4 << 20, store=store, pin_memory=False)
            claims = FleetClaims(store, trace=log)
            made.append((store, cache, claims, log, EncodePipeline(cache, encoder, claims=claims)))
        (_, _, claimer, claimer_log, first), (_, _, waiter, waiter_log, second) = made
        outputs: dict[str, torch.Tensor] = {}
        items = [item(k) for k in keys]
        run = threading.Thread(target=lambda: outputs.update(w0=first.encode("w0", items, keys)))
        run.start()
        deadline = time.monotonic() + 30
        while claimer.stats().claimed < len(keys):  # the claimer claims first
            assert time.monotonic() < deadline and run.is_alive(), claimer_log.events
            time.sleep(0.005)
        outputs["w1"] = second.encode("w1", items, keys)
        run.join()
        want = torch.cat([torch.full(SHAPE, float(sum(k.encode()) % 97)) for k in keys])
        assert all(torch.equal(out, want) for out in outputs.values()), outputs
    finally:
        go.set()
        for store, cache, claims, _, _ in reversed(made):
            claims.close()
            cache.close()
            store.close()
    steps = [(e["action"], e["outcome"]) for e in waiter_log.events if e["key"] == "a"]
    assert steps == [("Ask", "miss"), ("Claim", "taken"), ("Poll", "won"), ("Encode", "loaded"),
                     ("Release", "late")], waiter_log.events  # fmt: skip
    assert waiter.stats().loaded == 3 and waiter.stats().taken_over == 0, waiter.stats()
    traces = [("w0", list(claimer_log.events)), ("w1", list(waiter_log.events))]
    checked = trace_mod.validate(traces, workers=2)
    rejected = [v.describe() for v in checked if not v.accepted]
    assert not rejected, "\n".join(rejected)
    assert len(checked) == 6


# ------------------------------------------------------------------ teeth: planted bugs


class WaitsPastTheLease(Client):
    """The bug: a worker takes a claim it found for live for one and a half leases (a stale
    answer kept for the key), so its wait neither takes the claim over nor gives up when that
    claim's lease ends: the store is asked again only once the half lease more has passed."""

    def __init__(self, master: Master, name: str) -> None:
        super().__init__(master, name)
        self.found: dict[str, float] = {}

    def claim(self, keys: Sequence[str]) -> list[int]:
        now = time.monotonic()
        if keys and all(now < self.found.get(k, -1.0) + 1.5 * self.claim_lease_s for k in keys):
            return [CLAIM_TAKEN] * len(keys)
        codes = super().claim(keys)
        for key, code in zip(keys, codes, strict=True):
            if code == CLAIM_TAKEN:
                self.found.setdefault(key, now)
        return codes


def test_a_wait_past_the_lease_is_rejected(fleet: Callable[..., list[Worker]]) -> None:
    for store, accepted in ((Client, True), (WaitsPastTheLease, False)):
        master = Master(LEASE_S)
        died = dead_claim(master, "x")
        [worker] = fleet(master, [[["x"]]], store=store)
        [verdict] = verdicts([worker], 2)
        assert verdict.accepted is accepted, verdict.describe()
    assert verdict.event is not None
    assert verdict.event["action"] == "Poll", verdict.describe()
    assert verdict.event["outcome"] in ("taken", "extended"), verdict.describe()
    # (in the tick the dead claimer's lease ended, or the next: a tick is half a lease)
    assert verdict.event["t"] >= died + LEASE_S / 2, verdict.describe()


def test_an_encode_before_the_lease_ends_is_rejected(
    fleet: Callable[..., list[Worker]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bug: a waiter waits a quarter of the lease on one claim, then encodes (no claim)
    # while the claim it found is live.
    for quarter, accepted in ((False, True), (True, False)):
        if quarter:
            monkeypatch.setattr(claims_module, "CLAIMS_WAITED", 1)
        master = Master(LEASE_S)
        dead_claim(master, "x")
        lease = LEASE_S / 4 if quarter else LEASE_S
        [worker] = fleet(master, [[["x"]]], lease_s=lease)
        [verdict] = verdicts([worker], 2)
        assert verdict.accepted is accepted, verdict.describe()
    assert verdict.event is not None
    assert (verdict.event["action"], verdict.event["outcome"]) == ("Poll", "fallback")
    assert worker.claims.stats().lease_ended == 1  # it did encode without the claim


# ------------------------------------------------------------------ conversion (no TLC)


def test_conversion_splits_keys_maps_time_to_ticks_and_drops_repeated_polls() -> None:
    def ev(seq: int, action: str, key: str, outcome: str, t: float) -> dict[str, Any]:
        return {"seq": seq, "action": action, "key": key, "outcome": outcome, "t": t}

    events = [
        {"seq": 1, "action": "Init", "key": "", "outcome": "", "t": 10.0, "lease_s": 1.0,
         "poll_s": 0.005, "claim_lease_s": 1.0},
        ev(2, "Ask", "a", "miss", 10.1), ev(3, "Claim", "a", "taken", 10.1),
        ev(4, "Ask", "b", "miss", 10.1), ev(5, "Claim", "b", "won", 10.1),
        ev(6, "Poll", "a", "taken", 10.2), ev(7, "Poll", "a", "taken", 10.6),
        ev(8, "Poll", "a", "taken", 10.7), ev(9, "Poll", "a", "extended", 11.1),
    ]  # fmt: skip
    a, b = trace_mod.convert(list(reversed(events)), "t")  # (ordered by seq)
    assert [(e["a"], e["out"], e["n"]) for e in a.events] == [
        ("Ask", "miss", 2), ("Claim", "taken", 2), ("Poll", "taken", 3), ("Poll", "extended", 4),
    ]  # fmt: skip
    assert [e["seq"] for e in a.source] == [2, 3, 7, 9]
    assert (b.name, len(b.events)) == ("t[b]", 2)
    text = trace_mod.module_text("M", [a, b], workers=3)
    assert "INSTANCE TraceFleetClaims" in text and '{"me", "w1", "w2"}' in text
