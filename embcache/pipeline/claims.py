"""``FleetClaims``: one encode per key across encode workers that share a global store.

Theory of operation. Inside one process, single flight is the cache's reservation (the request
that reserved a miss encodes it; the others wait). ``FleetClaims`` carries that across processes
through a ``ClaimingStore`` (Mooncake's: a claim is a started, never-ended put of ``key#claim``,
which exactly one racing worker wins, with the master's put timeout as its lease;
embcache/DESIGN.md, "Claims").

1. ``claim(keys)``: misses a request reserved (in neither the pool nor the store at its
   lookup) or that its pool refused. One store call claims them all, one asks whether the
   keys won are stored after all (published and released since the lookup: released and
   waited on, which loads it). A key claimed is this worker's to encode.
   ``wait(request, items)``: a key another worker holds a live claim on (``CLAIM_TAKEN``) is
   waited for, with no lock held (the pipeline encodes its own claimed keys first): at once,
   then every ``poll_s``, the waiter asks the store whether the key is stored (the claimer's
   publish is visible) and claims the rest again. Stored: read into the request's reserved
   range (``begin_fill``, ``get_into``, ``end_fill``) or, if the pool will not take it, as a
   copy (``get_copies``). Claimed now (released, or its lease ended): asked once more whether
   it is stored, else encoded under the new claim. Still taken at ``lease_s`` after the wait
   began: a newer claim, one more lease. Anything else (no master, a refusal), a failed read,
   or a key taken after ``CLAIMS_WAITED`` claims: encoded here, without a claim. A wait lasts
   at most one lease per claim it waits on and never fails: it falls back item by item.
2. The caller encodes what it claimed and what ``wait`` did not load, inserts it with
   ``publish=True`` and calls ``published(keys)`` for the claimed keys the pool took: a
   background thread releases each claim once the key is stored, or at its lease end by this
   worker's clock (a publish that failed); ``publish_copies(outputs)`` the others: a host copy
   put into the store (``put_copies``), then ``published``. No claim is released before its
   publish is visible. ``release(keys)``: at once (a failed encode, a copy not stored).

A claim carries and decides no bytes: a lost, stale or doubled claim costs a duplicate encode,
never a wrong answer. At most one claim per key per worker, while its encode and publish are in
flight (why, the bounds and the costs: embcache/DESIGN.md, "Claims").

Trace. With ``trace=`` (a ``TraceSink``, called with no lock held), each step is one event, as
``tla/FleetClaims.tla`` names it (checked by ``tla/claims_trace.py``; tla/README.md lists them).

Threads and locks. ``claim`` and ``wait`` run on the request's thread (a wait sleeps holding
no lock); the releaser is one daemon thread, started at the first ``published``. ``_lock``
guards its queue, the counters and ``seq``, never across a store call or the trace sink.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from embcache.core.outcomes import TransferOutcome
from embcache.driver.global_store import (
    CLAIM_EXPIRED,
    CLAIM_TAKEN,
    ClaimingStore,
    CopyingStore,
    get_outcome,
)
from embcache.driver.item import Item
from embcache.driver.locks import assert_unlocked
from embcache.driver.request import Request
from embcache.driver.trace import TraceSink
from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["ClaimStats", "FleetClaims", "Settled"]

DEFAULT_POLL_S = 0.005
#: Claims a waiter waits on, one after the other, before it encodes without a claim: the one it
#: found, and the one that took that over at its lease's end (another waiter's).
CLAIMS_WAITED = 2


@dataclass(frozen=True)
class Settled:
    """What ``wait`` decided: ``mine``, the keys this worker claimed (encode them, then
    ``published`` or ``publish_copies``, or ``release``); ``loaded``, the keys read from the
    store after another worker's publish: held by the request, or, for a key its pool did not
    take, in ``copies`` (the object's bytes, a new CPU uint8 tensor). Every other key given is
    encoded without a claim."""

    mine: list[str]
    loaded: list[str]
    copies: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ClaimStats:
    """Counters since the claims were made, per key.

    ``claimed``: claims won at the first ask. ``waited``: keys found claimed by another worker.
    ``loaded``: waited keys served from the store. ``taken_over``: waited keys claimed later
    (released unpublished, or its lease ended). ``lease_ended``: waited keys encoded when the
    wait reached the lease, without a claim. ``unclaimed``: keys encoded without a claim because
    the store did not answer a claim (no master). ``load_failed``: waited keys whose read failed.
    ``released``: claims ended by this worker. ``expired``: claims found taken by another worker
    when released (this worker's lease ended first: its encode and the other's may both run).
    ``copied``: claimed keys the pool did not take, published by ``publish_copies``.
    ``read_copies``: loaded keys the pool did not take, read as copies (``Settled.copies``).
    """

    claimed: int
    waited: int
    loaded: int
    taken_over: int
    lease_ended: int
    unclaimed: int
    load_failed: int
    released: int
    expired: int
    copied: int
    read_copies: int


class FleetClaims:
    """Claims on ``store`` for one encode worker (module docstring: the protocol).

    ``lease_s`` (default: the store's ``claim_lease_s``) bounds every wait; ``poll_s`` spaces
    the store calls of a wait and of the releaser. ``clock`` is a monotonic clock in seconds.
    ``trace`` receives the protocol's events (module docstring, "Trace").
    """

    def __init__(
        self,
        store: ClaimingStore,
        *,
        lease_s: float | None = None,
        poll_s: float = DEFAULT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
        trace: TraceSink | None = None,
    ) -> None:
        if not isinstance(store, ClaimingStore):
            raise InvalidTypeError(
                f"FleetClaims needs a store with claim/release, got {type(store).__name__}"
            )
        lease = store.claim_lease_s if lease_s is None else lease_s
        for name, value in (("lease_s", lease), ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidTypeError(f"{name} must be seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"{name} must be finite seconds > 0, got {value}")
        self._store = store
        self._copies = store if isinstance(store, CopyingStore) else None
        self._lease_s = float(lease)
        self._poll_s = float(poll_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        # Guarded by _lock:
        self._counts: Counter[str] = Counter()
        self._held: dict[str, float] = {}  # key -> when its claim's lease ends (own clock)
        self._publishing: set[str] = set()  # held keys whose publish has started
        self._releaser: threading.Thread | None = None
        self._closed = False
        self._trace = trace
        self._seq = 0  # the last trace event's
        self._emit("Init", "", "", self._clock(), lease_s=self._lease_s, poll_s=self._poll_s,
                   claim_lease_s=float(store.claim_lease_s))

    @property
    def lease_s(self) -> float:
        """The longest a wait lasts. O(1)."""
        return self._lease_s

    def stats(self) -> ClaimStats:
        """A snapshot of the counters. O(1)."""
        with self._lock:
            c = Counter(self._counts)
        return ClaimStats(**{name: c[name] for name in ClaimStats.__dataclass_fields__})

    # -- the request's side ----------------------------------------------------------------

    def claim(self, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """Claim ``keys`` (misses a request reserved, each once): (claimed here: encode them,
        then ``published`` or ``release``; claimed by another worker: ``wait`` on them). The
        rest are encoded without a claim (no master). Never raises for a store failure."""
        assert_unlocked("FleetClaims.claim")
        mine: list[str] = []
        waiting: list[str] = []
        if not keys:
            return mine, waiting
        asked, codes = self._claim(list(keys))
        for key, code in zip(keys, codes, strict=True):
            if code == 0:
                mine.append(key)
            elif code == CLAIM_TAKEN:
                waiting.append(key)
        unclaimed = len(keys) - len(mine) - len(waiting)
        if mine:  # published (and released) by another worker since this request's lookup?
            stored = self._stored(mine)
            late = [key for key in mine if stored[key]]
            if late:
                self._end(late)
                mine = [key for key in mine if not stored[key]]
                waiting += late  # (``wait`` loads them at its first ask)
        for key in mine:
            self._emit("Ask", key, "miss", asked)
            self._emit("Claim", key, "won", asked)
        self._count(claimed=len(mine), waited=len(waiting), unclaimed=unclaimed)
        return mine, waiting

    def wait(self, request: Request, items: Sequence[Item]) -> Settled:
        """Wait on other workers' claims of ``items`` (``claim``'s second list, reserved by
        ``request``) and load what they publish; what this worker must now encode under a
        claim, and what it loaded. Never raises for a store failure; waits at most one lease
        per claim it waits on."""
        assert_unlocked("FleetClaims.wait")
        by_key = {item.key: item for item in items}
        copies: dict[str, torch.Tensor] = {}
        try:
            loaded, mine = self._wait(request, by_key, list(by_key), copies)
        except BaseException:
            with self._lock:  # (only this request can hold claims on its reserved keys)
                held = [key for key in by_key if key in self._held]
            self.release(held)
            raise
        return Settled(mine, loaded, copies)

    def _wait(
        self, request: Request, by_key: dict[str, Item], keys: list[str],
        copies: dict[str, torch.Tensor],
    ) -> tuple[list[str], list[str]]:  # fmt: skip
        """Wait on other workers' claims of ``keys``: (loaded, claimed here); the keys loaded
        outside the pool into ``copies``."""
        at = self._clock()
        deadline = at + self._lease_s
        rounds = 1
        loaded: list[str] = []
        mine: list[str] = []
        pending = keys
        first = True  # (the first ask at once: the caller has encoded its own keys since)
        while pending:
            if not first:
                time.sleep(max(0.0, min(self._poll_s, deadline - self._clock())))
                at = self._clock()
            last = at >= deadline  # one more ask at the deadline: the claim's lease has ended
            ask = "Ask" if first else "Poll"
            stored = self._stored(pending)
            got = self._load(request, [by_key[k] for k in pending if stored[k]], copies)
            held = set(got)
            for key in pending:
                if stored[key]:
                    self._emit(ask, key, ("hit" if first else "loaded") if key in held
                               else "load_failed", at)  # fmt: skip
            loaded += got
            rest = [k for k in pending if not stored[k]]
            pending = []
            taken: list[str] = []
            _, codes = self._claim(rest) if rest else (at, [])
            for key, code in zip(rest, codes, strict=True):
                if first:
                    self._emit("Ask", key, "miss", at)
                outcome = "taken" if code == CLAIM_TAKEN else "won" if code == 0 else "none"
                if not (last and code == CLAIM_TAKEN):  # (at the deadline: extended or not)
                    self._emit("Claim" if first else "Poll", key, outcome, at)
                if code == CLAIM_TAKEN:
                    pending.append(key)
                elif code == 0:
                    taken.append(key)
                else:
                    self._count(unclaimed=1)
            first = False
            if taken:
                stored = self._stored(taken)
                late = [k for k in taken if stored[k]]  # published just before its release
                for key in late:
                    self._emit("Encode", key, "loaded", at)
                self._release(late, "late")
                loaded += self._load(request, [by_key[k] for k in late], copies)
                mine += [k for k in taken if not stored[k]]
                self._count(taken_over=len(taken) - len(late))
            if last and pending:
                if rounds == CLAIMS_WAITED:
                    for key in pending:
                        self._emit("Poll", key, "fallback", at)
                    self._count(lease_ended=len(pending))
                    break
                rounds += 1  # taken again at the old claim's lease end: a newer claim
                extended = self._clock()
                deadline = extended + self._lease_s
                for key in pending:
                    self._emit("Poll", key, "extended", extended)
        return loaded, mine

    def _load(
        self, request: Request, items: list[Item], copies: dict[str, torch.Tensor]
    ) -> list[str]:
        """Read ``items`` from the store into the request's ranges (``begin_fill``: its
        reservation, or a range its pool takes now); an item the pool does not take, as a copy
        into ``copies`` (a ``CopyingStore``). The keys loaded."""
        if not items:
            return []
        offsets = request.begin_fill(items)
        handed = [(item, at) for item, at in zip(items, offsets, strict=True) if at is not None]
        keys = [item.key for item, _ in handed]
        sizes = [item.nbytes for item, _ in handed]
        try:
            codes = self._store.get_into(keys, [at for _, at in handed], sizes)
            outcomes = [get_outcome(self._store, c, n) for c, n in zip(codes, sizes, strict=True)]
        except Exception:
            outcomes = [TransferOutcome.UNKNOWN] * len(keys)  # (the protocol: a raise is UNKNOWN)
        request.end_fill(keys, outcomes, publish=False)
        held = [k for k, o in zip(keys, outcomes, strict=True) if o is TransferOutcome.OK]
        refused = [item for item, at in zip(items, offsets, strict=True) if at is None]
        read = self._read_copies(refused)
        copies.update(read)
        self._count(loaded=len(held) + len(read), load_failed=len(items) - len(held) - len(read),
                    read_copies=len(read))  # fmt: skip
        return held + list(read)

    def _read_copies(self, items: list[Item]) -> dict[str, torch.Tensor]:
        """Copies of the objects of ``items`` (none without a ``CopyingStore``)."""
        if not items or self._copies is None:
            return {}
        try:
            got = self._copies.get_copies([it.key for it in items], [it.nbytes for it in items])
        except Exception:
            return {}
        return {
            it.key: data
            for it, data in zip(items, got, strict=False)
            if isinstance(data, torch.Tensor) and data.nbytes == it.nbytes
        }

    # -- releases ------------------------------------------------------------------------

    def published(self, keys: Sequence[str]) -> None:
        """Release these claims once their keys are stored, or at their lease end by this
        worker's clock (a publish that failed)."""
        if not keys:
            return
        now = self._clock()
        for key in keys:
            self._emit("Encode", key, "encoded", now)
        with self._lock:
            if self._closed:
                closed = list(keys)
            else:
                closed = []
                self._publishing.update(keys)
                if self._releaser is None:
                    self._releaser = threading.Thread(
                        target=self._release_published, name="embcache-claims", daemon=True
                    )
                    self._releaser.start()
                self._work.notify()
        self._release(closed, "closed")

    def publish_copies(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """Publish the outputs of keys claimed here that the pool did not take: a host copy of
        each is put into the store (``put_copies``) on this thread, with no lock held; each key
        stored is then ``published`` (released once ``exists`` sees it), every other one
        released now, as is every key when the store cannot copy. Never raises for a store
        failure; raises ``InvalidTypeError`` / ``InvalidArgumentError`` for a mapping of
        anything but tensors or a key this worker holds no claim on (nothing is put then)."""
        assert_unlocked("FleetClaims.publish_copies")
        if not isinstance(outputs, Mapping):
            raise InvalidTypeError(f"outputs must map keys to tensors: {type(outputs).__name__}")
        bad = [k for k, v in outputs.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise InvalidTypeError(f"outputs must be tensors: {bad[:3]} are not")
        with self._lock:
            stray = [k for k in outputs if k not in self._held or k in self._publishing]
        if stray:
            raise InvalidArgumentError(f"no claim held here awaits a publish of {stray[:3]}")
        keys = list(outputs)
        if not keys:
            return
        codes = [-1] * len(keys)
        if self._copies is not None:
            try:
                hosts = [_on_host(value) for value in outputs.values()]
                codes = self._copies.put_copies(keys, hosts)
            except Exception:
                codes = [-1] * len(keys)  # (released below: a duplicate, never an error)
            if len(codes) != len(keys):
                codes = [-1] * len(keys)
        stored = [key for key, code in zip(keys, codes, strict=True) if code == 0]
        self._count(copied=len(stored))
        self.published(stored)
        self.release([key for key, code in zip(keys, codes, strict=True) if code != 0])

    def release(self, keys: Sequence[str]) -> None:
        """End these claims now, with nothing published (a failed encode, a key the pool did
        not take); never raises for a store failure."""
        now = self._clock()
        for key in keys:
            self._emit("EncodeFails", key, "", now)
        self._end(keys)

    def _release(self, keys: Sequence[str], why: str) -> None:
        """End these claims now (``why``: the trace's outcome)."""
        now = self._clock()
        for key in keys:
            self._emit("Release", key, why, now)
        self._end(keys)

    def _end(self, keys: Sequence[str]) -> None:
        """Revoke these claims. A claim whose lease ended by this worker's clock, or that the
        store says another took, counts ``expired``: it was no longer this worker's, whatever
        the revoke answers (Mooncake answers 0 when the claimer that took it over has already
        released it)."""
        if not keys:
            return
        with self._lock:
            ends = [self._held.pop(key, 0.0) for key in keys]
        self._revoke(keys, ends)

    def _revoke(self, keys: Sequence[str], ends: Sequence[float]) -> None:
        """``_end``'s store call, for claims already taken out of ``_held`` (their lease ends
        by this worker's clock in ``ends``)."""
        if not keys:
            return
        assert_unlocked("FleetClaims.release")
        try:
            codes = self._store.release(list(keys))
        except Exception:
            codes = [-1] * len(keys)
        now = self._clock()
        lost = [code == CLAIM_EXPIRED or now >= end for code, end in zip(codes, ends, strict=False)]
        self._count(
            released=sum(code == 0 and not x for code, x in zip(codes, lost, strict=False)),
            expired=sum(lost),
        )

    def _release_published(self) -> None:
        """The releaser: every ``poll_s``, release the claims whose keys are stored or due."""
        while True:
            with self._lock:
                self._work.wait_for(lambda: bool(self._publishing) or self._closed)
                if self._closed:
                    return
                due = {k: self._held.get(k, 0.0) for k in self._publishing}
            stored = self._stored(list(due))
            now = self._clock()
            done = [k for k, ends in due.items() if stored[k] or now >= ends]
            with self._lock:  # (one hold: no key is held here but no longer publishing)
                self._publishing.difference_update(done)
                ends = [self._held.pop(key, 0.0) for key in done]
            for key in done:
                self._emit("Release", key, "stored" if stored[key] else "lease", now)
            self._revoke(done, ends)
            time.sleep(self._poll_s)

    def close(self) -> None:
        """Release every claim still waiting for its publish and stop the releaser."""
        with self._lock:
            self._closed = True
            left = list(self._publishing)
            self._publishing.clear()
            releaser = self._releaser
            self._work.notify_all()
        if releaser is not None:
            releaser.join()
        self._release(left, "closed")

    # -- store calls ---------------------------------------------------------------------

    def _claim(self, keys: list[str]) -> tuple[float, list[int]]:
        """Claim ``keys``: (when asked, the answers). Each claim won is held until the lease
        from just before the ask (the store's lease began after it, so this worker's end
        comes first)."""
        asked = self._clock()
        ends = asked + self._lease_s
        try:
            codes = self._store.claim(keys)
        except Exception:
            return asked, [-1] * len(keys)  # no claim: encode here
        if len(codes) != len(keys):
            return asked, [-1] * len(keys)
        with self._lock:
            for key, code in zip(keys, codes, strict=True):
                if code == 0:
                    self._held[key] = ends
        return asked, codes

    def _stored(self, keys: list[str]) -> dict[str, bool]:
        """Whether each key is stored; a store that fails says none is (claims then decide)."""
        try:
            found = self._store.exists(keys)
        except Exception:
            found = [False] * len(keys)
        return dict(zip(keys, found, strict=True))

    def _count(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def _emit(self, action: str, key: str, outcome: str, at: float, **fields: float) -> None:
        """One trace event (none without a trace), handed to the sink with no lock held."""
        if self._trace is None:
            return
        with self._lock:
            self._seq += 1
            seq = self._seq
        event = {"seq": seq, "action": action, "key": key, "outcome": outcome, "t": at, **fields}
        self._trace.append(event)


def _on_host(value: torch.Tensor) -> torch.Tensor:
    """``value`` itself when it is a contiguous CPU tensor, else a contiguous CPU copy of it
    (from any device: the store copies host bytes)."""
    value = value.detach()
    if value.device.type == "cpu" and value.is_contiguous():
        return value
    host = torch.empty(value.shape, dtype=value.dtype)
    host.copy_(value)
    return host
