"""The fleet-claims reference model (``models/claims.py``) against ``tla/FleetClaims.tla``.

Hypothesis drives the model through random fleets (2 or 3 workers, 1 or 2 keys, leases of 1 to
3 ticks, any set of failures), one step the spec allows at a time, and checks after each step
the spec's safety properties (NoWrongBytes, NoWaitPastLease, ClaimExclusive without restarts,
EncodedOnce without failures), that no state is stuck, and WaitEnds: run fairly from there,
every waiting request ends. The model is the spec step for step: on ClaimsLiveness's constants
(no symmetry) it reaches exactly the distinct states TLC counts (``tla/expected.json``; on
Claims', ClaimsFaults' and ClaimsRestart's constants without symmetry it reaches TLC's 2153,
15558 and 56376), and four of the spec's mutants, put into the model, break the property TLC
reports for them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from models import claims
from models.claims import ALL_FAULTS, OWNED, WAITING, Fleet, reachable, successors

TLA = Path(__file__).resolve().parents[2] / "tla"
UNFAIR = {"Ask", "Crash", "EncodeFails", "Restart"}  # requests and failures: no fairness


def fair_run(fleet: Fleet, bound: int = 500) -> Fleet:
    """Run only the steps the spec's fairness covers (work, time, expiry) until none is left."""
    fleet = fleet.copy()
    for _ in range(bound):
        step = next((s for s in successors(fleet) if s[0] not in UNFAIR), None)
        if step is None:
            return fleet
        fleet = step[2]
    raise AssertionError(f"no end after {bound} fair steps: {fleet.snapshot()}")


def not_stuck(fleet: Fleet) -> bool:
    """A step is possible, or the behaviour is over (the spec's Done)."""
    return fleet.done() or any(True for _ in successors(fleet))


class ClaimsMachine(RuleBasedStateMachine):
    @initialize(
        workers=st.integers(2, 3),
        keys=st.integers(1, 2),
        lease=st.integers(1, 3),
        faults=st.frozensets(st.sampled_from(sorted(ALL_FAULTS))),
    )
    def setup(self, workers: int, keys: int, lease: int, faults: frozenset[str]) -> None:
        self.fleet = Fleet(
            [f"w{i}" for i in range(workers)], [f"k{i}" for i in range(keys)], lease, faults
        )

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        steps = list(successors(self.fleet))
        if steps:
            _, _, self.fleet = data.draw(st.sampled_from(steps), label="step")

    @invariant()
    def safe(self) -> None:
        if hasattr(self, "fleet"):
            self.fleet.check_invariants()
            assert not_stuck(self.fleet), self.fleet.snapshot()

    @invariant()
    def every_wait_ends(self) -> None:
        if hasattr(self, "fleet") and any(s.phase == WAITING for s in self.fleet.ws.values()):
            after = fair_run(self.fleet)
            assert not any(s.phase == WAITING for s in after.ws.values()), after.snapshot()


TestClaimsMachine = ClaimsMachine.TestCase


def model_of(config: str, model: type[Fleet] = Fleet) -> Fleet:
    """A fleet (of this model) with the constants of tla/models/<config>.cfg."""
    text = (TLA / "models" / f"{config}.cfg").read_text()

    def names(constant: str) -> list[str]:
        m = re.search(rf"^\s*{constant} = \{{(.*?)\}}", text, re.M)
        assert m, (config, constant)
        return [n.strip().strip('"') for n in m.group(1).split(",") if n.strip()]

    lease = re.search(r"^\s*Lease = (\d+)", text, re.M)
    assert lease
    return model(names("Workers"), names("Keys"), int(lease.group(1)), frozenset(names("Faults")))


def test_the_model_reaches_the_states_tlc_counts() -> None:
    """ClaimsLiveness has no symmetry: TLC's distinct states are the spec's reachable states,
    and the model's, counted the same way, must be as many; all are safe and none is stuck."""
    manifest = json.loads((TLA / "expected.json").read_text())["models"]["ClaimsLiveness"]
    states = reachable(model_of("ClaimsLiveness"))
    assert len(states) == manifest["distinct"]
    for fleet in states.values():
        fleet.check_invariants()
        assert not_stuck(fleet), fleet.snapshot()


class ReclaimAtDeadline(Fleet):
    """Mutant claims_wait_past_lease: a waiter's polls look for the publish only; it claims
    again only at its deadline."""

    def poll(self, w: str, k: str, ask: str) -> bool:
        s = self.ws[w, k]
        if s.phase != WAITING or ask != "missed" or ask not in self.asks(w, k):
            return super().poll(w, k, ask)
        if not self.free(k) or s.timer == 0:
            return super().poll(w, k, ask)
        missed = not self.complete(k)
        if s.polled and s.missed == missed:
            return False
        self.ws[w, k] = dataclasses.replace(s, polled=True, missed=missed)
        return True


class ReleaseAtPut(Fleet):
    """Mutant claims_release_before_publish: the claim goes when the put starts."""

    def begin_publish(self, w: str, k: str) -> bool:
        s = self.ws[w, k]
        if s.phase != claims.PUBLISH or self.data[k] is not None or not s.own:
            return super().begin_publish(w, k)
        self.remove_claim(w, k)
        self.data[k] = claims.Obj(claims.WRITING, claims.GARBAGE, w)
        self.ws[w, k] = claims.Work(phase=claims.PUBLISHING, got=s.got)
        return True


class RemoveAnyClaim(Fleet):
    """Mutant claims_expired_claim_as_own: the remove ignores that the lease ended."""

    def remove_claim(self, w: str, k: str) -> None:
        self.claim[k] = None


class NoSecondLook(Fleet):
    """Mutant claims_no_second_look: a claim won, the worker encodes without a look."""

    def encode(self, w: str, k: str) -> bool:
        s = self.ws[w, k]
        if s.phase != OWNED:
            return super().encode(w, k)
        self.ws[w, k] = dataclasses.replace(s, phase=claims.PUBLISH, got=claims.enc(k))
        self.encodes[k] += 1
        return True


MUTANTS: list[tuple[str, str, type[Fleet], str]] = [
    ("claims_wait_past_lease", "ClaimsFaults", ReclaimAtDeadline, "no_wait_past_lease"),
    ("claims_release_before_publish", "Claims", ReleaseAtPut, "encoded_once"),
    ("claims_expired_claim_as_own", "ClaimsFaults", RemoveAnyClaim, "claim_exclusive"),
    ("claims_no_second_look", "Claims", NoSecondLook, "encoded_once"),
]


@pytest.mark.parametrize(("mutant", "config", "model", "prop"), MUTANTS)
def test_the_models_checks_catch_the_specs_mutants(
    mutant: str, config: str, model: type[Fleet], prop: str
) -> None:
    """Each mutant TLC rejects (tla/mutants/<mutant>.mutant), put into the model, breaks the
    property TLC names, in some state the model reaches on that mutant's TLC model."""
    assert (TLA / "mutants" / f"{mutant}.mutant").is_file()
    assert all(getattr(s, prop)() for s in reachable(model_of(config)).values())
    assert not all(getattr(s, prop)() for s in reachable(model_of(config, model)).values())
