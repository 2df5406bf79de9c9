"""Reference model of fleet claims (DESIGN.md, "Claims"): ``tla/FleetClaims.tla`` in Python.

Workers on one store claim a miss before they encode it. The store holds per key the published
object (none, a put in progress, complete; a get sees only a complete one) and a claim under a
key of its own (owner, lease left), as measured on a real master: a claim (a put started and
never ended) is won by exactly one of racing starts, refused while live, and won by the next
start once its lease ended; a put of the bytes stores nothing if the key exists; a release (a
revoke) ends only the releaser's own claim. A refused worker waits, polling: it loads the
publish, or claims again and takes the claim over once it ended; at its deadline (a lease after
its wait began) still refused, it waits one more lease on the newer claim, up to
``claims_waited`` claims, then encodes itself with no claim.

Each action is a method with the spec's name in snake case (``Ask`` is ``ask``, ``BeginPublish``
is ``begin_publish``) and the spec's guard and effect, field for field: it returns False and
changes nothing when the spec's guard is false. ``ACTIONS`` lists them with their parameters,
``successors`` enumerates every step, and ``snapshot`` is the spec's state as a hashable value,
so the states this model reaches can be counted and compared with TLC's. Time is countdowns: a
claim's lease, its owner's view of it and a waiter's timer tick down together (``tick``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

CRASH, SLOW, FAIL, RESTART = "crash", "slow", "fail", "restart"
CLAIMS_WAITED = 2  # the spec's ClaimsWaited in every model (embcache/pipeline/claims.py's too)
ALL_FAULTS = frozenset({CRASH, SLOW, FAIL, RESTART})

# A worker's phase for one key (the spec's names).
IDLE, CLAIMING, OWNED, WAITING, FALLBACK = "idle", "claiming", "owned", "waiting", "fallback"
PUBLISH, PUBLISHING, RELEASE = "publish", "publishing", "release"
DONE, FAILED, DEAD = "done", "failed", "dead"
TERMINAL = frozenset({DONE, FAILED, DEAD})

# The store's object of a key.
WRITING, COMPLETE = "writing", "complete"
GARBAGE = "garbage"  # the bytes of a half-written object: no encoder's output


def enc(key: str) -> str:
    """The encoder's output for ``key`` (it is deterministic)."""
    return f"enc:{key}"


@dataclasses.dataclass(frozen=True)
class Obj:
    """A published object: a put in progress (``GARBAGE`` bytes) or complete."""

    state: str
    bytes: str
    by: str


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claim in the store: its owner and the ticks left of its lease."""

    owner: str
    left: int


@dataclasses.dataclass(frozen=True)
class Work:
    """Worker w's work on key k: its phase; ``own``: it believes it holds k's claim; ``timer``:
    that claim's lease left as it counts it (an owner) or the ticks to its deadline (a waiter);
    ``lease``: the lease left of the claim a waiter last found (a ghost: the store's count);
    ``rounds``: the claims a waiter has waited on; ``polled``: a waiter polled since the last
    tick; ``got``: the bytes it holds and serves; ``missed``: a ghost, the key was not stored at
    a waiter's last claim or poll (its next poll's ask may miss a publish visible since)."""

    phase: str = IDLE
    own: bool = False
    timer: int = 0
    lease: int = 0
    rounds: int = 0
    polled: bool = False
    got: str | None = None
    missed: bool = False


IDLE_WORK = Work()
#: What a poll's ask answered: the key stored, or not (``Fleet.poll``).
ASKS = ("stored", "missed")


class Fleet:
    """Workers, keys, the store and the clock; one method per action of the spec."""

    def __init__(
        self, workers: list[str], keys: list[str], lease: int, faults: frozenset[str]
    ) -> None:
        assert lease >= 1 and faults <= ALL_FAULTS
        self.workers, self.keys, self.lease, self.faults = workers, keys, lease, faults
        self.data: dict[str, Obj | None] = {k: None for k in keys}
        self.claim: dict[str, Claim | None] = {k: None for k in keys}
        self.ws: dict[tuple[str, str], Work] = {(w, k): IDLE_WORK for w in workers for k in keys}
        self.encodes: dict[str, int] = {k: 0 for k in keys}
        self.restarts = 0

    def copy(self) -> Fleet:
        other = type(self)(self.workers, self.keys, self.lease, self.faults)
        other.data, other.claim = dict(self.data), dict(self.claim)
        other.ws, other.encodes = dict(self.ws), dict(self.encodes)
        other.restarts = self.restarts
        return other

    def snapshot(self) -> tuple[Any, ...]:
        """The spec's state (data, claim, ws, encodes, restarts) as a hashable value."""
        return (
            tuple(self.data[k] for k in self.keys),
            tuple(self.claim[k] for k in self.keys),
            tuple(self.ws[w, k] for w in self.workers for k in self.keys),
            tuple(self.encodes[k] for k in self.keys),
            self.restarts,
        )

    def complete(self, k: str) -> bool:
        obj = self.data[k]
        return obj is not None and obj.state == COMPLETE

    def after_publish(self, s: Work) -> Work:
        """After its publish a claimer removes its claim; anyone else is done."""
        return dataclasses.replace(s, phase=RELEASE if s.own else DONE)

    def asks(self, w: str, k: str) -> tuple[str, ...]:
        """What the ask of w's poll of k may answer (the spec's Looks): the poll asks, then
        claims (two calls), and is its claim's step; its ask came after w's last claim or
        poll, so an object complete now may have been missed if it was not complete then."""
        if not self.complete(k):
            return ("missed",)
        return ASKS if self.ws[w, k].missed else ("stored",)

    def free(self, k: str) -> bool:
        """k's claim can be won: there is none, or its lease has ended."""
        current = self.claim[k]
        return current is None or current.left == 0

    def take(self, w: str, k: str) -> None:
        """w's claim of k wins: w holds it for a lease."""
        self.claim[k] = Claim(w, self.lease)
        self.ws[w, k] = Work(phase=OWNED, own=True, timer=self.lease)

    def remove_claim(self, w: str, k: str) -> None:
        """w revokes its claim of k: the master ends it only if it is w's."""
        current = self.claim[k]
        if current is not None and current.owner == w:
            self.claim[k] = None

    # ----------------------------------------------------------- a worker's steps for one key

    def ask(self, w: str, k: str) -> bool:
        """A request misses k at w; w asks the store (a get sees only a complete object)."""
        if self.ws[w, k].phase != IDLE:
            return False
        obj = self.data[k]
        if obj is not None and obj.state == COMPLETE:
            self.ws[w, k] = Work(phase=DONE, got=obj.bytes)
        else:
            self.ws[w, k] = Work(phase=CLAIMING)
        return True

    def claim_key(self, w: str, k: str) -> bool:
        """The spec's Claim: w's start wins if no live claim is there, else w waits on it."""
        if self.ws[w, k].phase != CLAIMING:
            return False
        current = self.claim[k]
        if current is None or current.left == 0:
            self.take(w, k)
        else:
            self.ws[w, k] = Work(
                phase=WAITING,
                timer=self.lease,
                lease=current.left,
                rounds=1,
                polled=True,
                missed=not self.complete(k),
            )
        return True

    def poll(self, w: str, k: str, ask: str) -> bool:
        """One poll of a waiter whose ask answered ``ask`` (one of ``asks``): load the publish
        (stored), or claim again (a takeover once the claim it found ended; a publish the ask
        missed is loaded by the claimer's second look); refused at its deadline, wait on the
        newer claim or, after ``CLAIMS_WAITED`` claims, encode with no claim. A poll that
        changes nothing is no step."""
        s = self.ws[w, k]
        if s.phase != WAITING or ask not in self.asks(w, k):
            return False
        obj, current = self.data[k], self.claim[k]
        found = s.lease if current is None or current.left == 0 else current.left
        missed = not self.complete(k)
        if ask == "stored":
            assert obj is not None
            self.ws[w, k] = Work(phase=DONE, got=obj.bytes)
        elif self.free(k):
            self.take(w, k)
        elif s.timer == 0 and s.rounds == CLAIMS_WAITED:
            self.ws[w, k] = Work(phase=FALLBACK)
        elif s.timer == 0:
            self.ws[w, k] = dataclasses.replace(
                s, timer=self.lease, rounds=s.rounds + 1, lease=found, polled=True, missed=missed
            )
        elif s.polled and s.lease == found and s.missed == missed:
            return False
        else:
            self.ws[w, k] = dataclasses.replace(s, lease=found, polled=True, missed=missed)
        return True

    def encode(self, w: str, k: str) -> bool:
        """The claimer re-checks the store (loads a publish visible by now) or encodes; a
        waiter that fell back encodes."""
        s = self.ws[w, k]
        if s.phase not in (OWNED, FALLBACK):
            return False
        obj = self.data[k]
        if s.phase == OWNED and obj is not None and obj.state == COMPLETE:
            self.ws[w, k] = dataclasses.replace(s, phase=RELEASE, got=obj.bytes)
        else:
            self.ws[w, k] = dataclasses.replace(s, phase=PUBLISH, got=enc(k))
            self.encodes[k] += 1
        return True

    def encode_fails(self, w: str, k: str) -> bool:
        """The claimer's encode fails: it removes its claim; its request gets the error."""
        if FAIL not in self.faults or self.ws[w, k].phase != OWNED:
            return False
        self.remove_claim(w, k)
        self.ws[w, k] = Work(phase=FAILED)
        return True

    def begin_publish(self, w: str, k: str) -> bool:
        """The put of the bytes, refused if the key exists (a duplicate)."""
        s = self.ws[w, k]
        if s.phase != PUBLISH:
            return False
        if self.data[k] is None:
            self.data[k] = Obj(WRITING, GARBAGE, w)
            self.ws[w, k] = dataclasses.replace(s, phase=PUBLISHING)
        else:
            self.ws[w, k] = self.after_publish(s)
        return True

    def end_publish(self, w: str, k: str) -> bool:
        """The put completes: visible with w's bytes, unless a restart took it."""
        s = self.ws[w, k]
        if s.phase != PUBLISHING:
            return False
        obj = self.data[k]
        if obj is not None and obj.state == WRITING and obj.by == w:
            assert s.got is not None
            self.data[k] = Obj(COMPLETE, s.got, w)
        self.ws[w, k] = self.after_publish(s)
        return True

    def release(self, w: str, k: str) -> bool:
        """The claimer releases once the key is stored, or once its lease ended by its clock."""
        s = self.ws[w, k]
        if s.phase != RELEASE or not (self.complete(k) or s.timer == 0):
            return False
        self.remove_claim(w, k)
        self.ws[w, k] = dataclasses.replace(s, phase=DONE, own=False, timer=0)
        return True

    def crash(self, w: str) -> bool:
        """A claimer's process dies mid-encode: its work on every key ends."""
        if CRASH not in self.faults or not any(self.ws[w, k].phase == OWNED for k in self.keys):
            return False
        for k in self.keys:
            if self.ws[w, k].phase not in TERMINAL:
                self.ws[w, k] = Work(phase=DEAD)
        return True

    # ------------------------------------------------------------------ the store and the clock

    def expire(self, k: str) -> bool:
        """A claim whose lease ended leaves the store."""
        current = self.claim[k]
        if current is None or current.left != 0:
            return False
        self.claim[k] = None
        return True

    def restart(self) -> bool:
        """The master restarts (once): every claim and object is gone (a waiter's next ask may
        miss an object published to the new master)."""
        if RESTART not in self.faults or self.restarts != 0:
            return False
        self.data = {k: None for k in self.keys}
        self.claim = {k: None for k in self.keys}
        self.restarts += 1
        for wk, s in self.ws.items():
            if s.phase == WAITING:
                self.ws[wk] = dataclasses.replace(s, missed=True)
        return True

    def tick(self) -> bool:
        """Time moves on one tick: every lease and timer counts down. Not before every waiter
        polled, nor (no slow claimers) while it would end the lease of a claim its owner still
        encodes or publishes."""
        works = self.ws.values()
        if not (any(c is not None and c.left > 0 for c in self.claim.values())
                or any(s.timer > 0 for s in works)):  # fmt: skip
            return False
        if any(s.phase == WAITING and not s.polled for s in works):
            return False
        busy = (OWNED, PUBLISH, PUBLISHING)
        if SLOW not in self.faults and any(
            s.own and s.phase in busy and s.timer <= 1 for s in works
        ):
            return False
        self.claim = {
            k: None if c is None else Claim(c.owner, max(c.left - 1, 0))
            for k, c in self.claim.items()
        }
        for wk, s in self.ws.items():
            timer = max(s.timer - 1, 0)
            if s.phase == WAITING:
                self.ws[wk] = dataclasses.replace(s, timer=timer, lease=s.lease - 1, polled=False)
            else:
                self.ws[wk] = dataclasses.replace(s, timer=timer)
        return True

    def done(self) -> bool:
        """Every worker is done with every key and no claim is left (the spec's Done)."""
        return all(s.phase in TERMINAL for s in self.ws.values()) and not any(self.claim.values())

    # ----------------------------------------------------------------------- the properties

    def no_wrong_bytes(self) -> bool:
        """Every byte a worker holds, and every complete object, is its key's encoder output."""
        return all(s.got in (None, enc(k)) for (_, k), s in self.ws.items()) and all(
            obj.bytes == enc(k) for k, obj in self.data.items() if obj and obj.state == COMPLETE
        )

    def no_wait_past_lease(self) -> bool:
        """No waiter waits once the lease of the claim it waits on has ended."""
        return all(s.lease >= 0 for s in self.ws.values() if s.phase == WAITING)

    def claim_exclusive(self) -> bool:
        """At most one worker holds a claim of a key whose lease is live (no restart)."""
        return all(
            sum(self.ws[w, k].own and self.ws[w, k].timer > 0 for w in self.workers) <= 1
            for k in self.keys
        )

    def encoded_once(self) -> bool:
        """Each key encoded at most once across the fleet (with no failure)."""
        return all(n <= 1 for n in self.encodes.values())

    def check_invariants(self) -> None:
        """The spec's invariants that this model's faults allow (as its models check them)."""
        assert self.no_wrong_bytes(), self.snapshot()
        assert self.no_wait_past_lease(), self.snapshot()
        if RESTART not in self.faults:
            assert self.claim_exclusive(), self.snapshot()
        if not self.faults:
            assert self.encoded_once(), self.snapshot()


# The spec's actions: name, method, what it ranges over ("wk": a worker and a key; "wka": and
# what a poll's ask answered).
ACTIONS: list[tuple[str, str, str]] = [
    ("Ask", "ask", "wk"),
    ("Claim", "claim_key", "wk"),
    ("Poll", "poll", "wka"),
    ("Encode", "encode", "wk"),
    ("EncodeFails", "encode_fails", "wk"),
    ("BeginPublish", "begin_publish", "wk"),
    ("EndPublish", "end_publish", "wk"),
    ("Release", "release", "wk"),
    ("Crash", "crash", "w"),
    ("Expire", "expire", "k"),
    ("Restart", "restart", ""),
    ("Tick", "tick", ""),
]


def arguments(fleet: Fleet, over: str) -> list[tuple[str, ...]]:
    """Every argument tuple an action ranges over ("wka": a worker, a key and an ask's answer)."""
    if over == "wka":
        return [(w, k, a) for w in fleet.workers for k in fleet.keys for a in ASKS]
    if over == "wk":
        return [(w, k) for w in fleet.workers for k in fleet.keys]
    if over == "w":
        return [(w,) for w in fleet.workers]
    if over == "k":
        return [(k,) for k in fleet.keys]
    return [()]


def successors(fleet: Fleet) -> Iterator[tuple[str, tuple[str, ...], Fleet]]:
    """Every step the spec allows from this state: (action, arguments, next state)."""
    after = fleet.copy()
    for name, method, over in ACTIONS:
        for args in arguments(fleet, over):
            step: Callable[..., bool] = getattr(after, method)
            if step(*args):  # a step not enabled changes nothing: its copy serves the next
                yield name, args, after
                after = fleet.copy()


def reachable(fleet: Fleet) -> dict[tuple[Any, ...], Fleet]:
    """Every state reachable from ``fleet``, by snapshot (breadth first, as TLC)."""
    seen = {fleet.snapshot(): fleet}
    frontier = [fleet]
    while frontier:
        following = []
        for state in frontier:
            for _, _, after in successors(state):
                key = after.snapshot()
                if key not in seen:
                    seen[key] = after
                    following.append(after)
        frontier = following
    return seen
