"""An in-process stand-in for one ``mooncake_master`` and its clients' claims, for the tests that
drive ``FleetClaims`` through thousands of random schedules (the differential test) or many
short traces (trace validation).

Why not a real master: those tests need hundreds of fleets per run, each with leases of a few
tens of milliseconds and a clock the test controls, while the real master's lease is its
``--put_start_discard_timeout_sec`` (whole seconds; a master start is seconds too). What the
stand-in does is what ``tests/mooncake_store/test_mooncake_create.py`` measured on a real
master (embcache/DESIGN.md, "Claims"), and those tests keep checking it there:

- a claim (``batch_put_session_start`` of ``key#claim``) is won by exactly one claimer and
  answers ``CLAIM_TAKEN`` (-705) to every other start while its lease lasts, its owner's
  included; once its lease ended the next start wins it;
- a release (``batch_put_session_revoke``) ends the releaser's own claim (0); a claim another
  took after its lease answers ``CLAIM_EXPIRED`` (-601); a claim that is gone answers 0 to a
  releaser that once held it (Mooncake: the put was revoked) and -600 to any other;
- a put of the bytes stores nothing if the key exists (the first put of a key stays); a get
  sees only a complete object.

``Master`` holds the objects and the claims; each ``Client`` is one worker's ``ClaimingStore``
(and ``CopyingStore``) with its own pool, as each worker's ``MooncakeStore`` is. ``Master.down``
makes every call answer ``RPC_FAIL`` (-900), as with the master gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from embcache.driver.global_store import CLAIM_EXPIRED, CLAIM_TAKEN, TransferOutcome

NOT_FOUND = -704
RPC_FAIL = -900
NOT_STARTED = -600


class Master:
    """The store's state: objects, claims (owner, when taken) and the lease, on ``clock``."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        self.claims: dict[str, tuple[str, float]] = {}
        self.started: set[tuple[str, str]] = set()  # (owner, key) of every claim won
        self.down = False

    def claim(self, owner: str, keys: Sequence[str]) -> list[int]:
        with self.lock:
            if self.down:
                return [RPC_FAIL] * len(keys)
            now = self.clock()
            codes = []
            for key in keys:
                held = self.claims.get(key)
                if held is not None and now - held[1] < self.lease_s:
                    codes.append(CLAIM_TAKEN)
                else:
                    self.claims[key] = (owner, now)
                    self.started.add((owner, key))
                    codes.append(0)
            return codes

    def release(self, owner: str, keys: Sequence[str]) -> list[int]:
        with self.lock:
            if self.down:
                return [RPC_FAIL] * len(keys)
            codes = []
            for key in keys:
                held = self.claims.get(key)
                if held is None:
                    codes.append(0 if (owner, key) in self.started else NOT_STARTED)
                elif held[0] != owner:
                    codes.append(CLAIM_EXPIRED if (owner, key) in self.started else NOT_STARTED)
                else:
                    del self.claims[key]
                    codes.append(0)
            return codes


class Client:
    """One worker's ``ClaimingStore`` on ``master``: its own pool, the master's objects."""

    def __init__(self, master: Master, name: str) -> None:
        self.master = master
        self.name = name
        self._pool: torch.Tensor | None = None

    @property
    def claim_lease_s(self) -> float:
        return self.master.lease_s

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._pool = buffer

    def exists(self, keys: Sequence[str]) -> list[bool]:
        master = self.master
        with master.lock:
            if master.down:
                raise ConnectionError("the stand-in master is down")
            return [key in master.objects for key in keys]

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        assert self._pool is not None
        codes = []
        for key, offset, size in zip(keys, offsets, sizes, strict=True):
            with self.master.lock:
                payload = None if self.master.down else self.master.objects.get(key)
            if payload is None or len(payload) != size:
                codes.append(NOT_FOUND if payload is None else 0)
                continue
            self._pool[offset : offset + size].copy_(
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            )
            codes.append(size)
        return codes

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        pool = self._pool
        assert pool is not None
        payloads = [
            pool[offset : offset + size].numpy().tobytes()
            for offset, size in zip(offsets, sizes, strict=True)
        ]
        return self._put(keys, payloads)

    def put_copies(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[int]:
        """A copy of each value's bytes, put as ``put_from`` puts (``CopyingStore``)."""
        return self._put(keys, [v.reshape(-1).view(torch.uint8).numpy().tobytes() for v in values])

    def _put(self, keys: Sequence[str], payloads: Sequence[bytes]) -> list[int]:
        """Store each payload under its key unless the key is stored (the first put stays)."""
        codes = []
        for key, payload in zip(keys, payloads, strict=True):
            with self.master.lock:
                if self.master.down:
                    codes.append(RPC_FAIL)
                    continue
                self.master.objects.setdefault(key, payload)
            codes.append(0)
        return codes

    def get_copies(self, keys: Sequence[str], sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """A new uint8 tensor of each object stored with exactly ``size`` bytes, else None."""
        with self.master.lock:
            found = [None if self.master.down else self.master.objects.get(k) for k in keys]
        return [
            None if p is None or len(p) != n else torch.frombuffer(bytearray(p), dtype=torch.uint8)
            for p, n in zip(found, sizes, strict=True)
        ]

    def classify(self, code: int) -> TransferOutcome:
        return TransferOutcome.FAILED if code == NOT_FOUND else TransferOutcome.UNKNOWN

    def fence(self) -> None:
        """Transfers are synchronous: none is ever in flight after its call."""

    def close(self) -> None:
        """Nothing to release."""

    def claim(self, keys: Sequence[str]) -> list[int]:
        return self.master.claim(self.name, keys)

    def release(self, keys: Sequence[str]) -> list[int]:
        return self.master.release(self.name, keys)
