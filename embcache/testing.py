"""Test support: ``FaultInjectingStore``, a ``GlobalStore`` in this process that injects faults.

A test double, never a production default: it keeps every object put into it, in a dict of
bytes with no byte budget, so nothing bounds its memory. Transfers copy between the dict and
the registered pool, outside the store's own lock. Faults are set per key: ``FAIL`` returns a
code that means nothing is in flight, ``UNKNOWN`` a code that means something may be, ``RAISE``
raises from the call, ``SHORT`` returns fewer bytes than asked, ``DELAY`` sleeps first,
``HOLD`` blocks the call until ``release_holds`` (or ``fence``), so tests can keep a transfer
in flight deterministically.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence

import torch

from embcache.driver.global_store import TransferOutcome
from embcache.errors import ClosedError, InvalidArgumentError

NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
TIMED_OUT = -1000
CLOSED = -1001


class Fault(enum.Enum):
    """An injectable misbehaviour of one key's transfers."""

    FAIL = "fail"
    UNKNOWN = "unknown"
    RAISE = "raise"
    SHORT = "short"
    DELAY = "delay"
    HOLD = "hold"


class InjectedError(RuntimeError):
    """Raised by a transfer whose key has the ``RAISE`` fault."""


class FaultInjectingStore:
    """A ``GlobalStore`` living in this process, for tests: faults on demand. Thread-safe."""

    def __init__(self, delay_seconds: float = 0.01) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._faults: dict[str, Fault] = {}
        self._delay = delay_seconds
        self._released = threading.Event()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._pool: torch.Tensor | None = None
        self._closed = False
        self.calls: dict[str, int] = {
            "exists": 0, "get_into": 0, "put_from": 0, "put_copies": 0, "get_copies": 0,
            "fence": 0,
        }

    # -- fault injection (tests) --
    def inject(self, key: str, fault: Fault | None) -> None:
        """Make every later transfer of ``key`` misbehave as ``fault`` (None clears it)."""
        with self._lock:
            if fault is None:
                self._faults.pop(key, None)
            else:
                self._faults[key] = fault
                if fault is Fault.HOLD:
                    self._released.clear()

    def release_holds(self) -> None:
        """Let every transfer blocked by a ``HOLD`` fault go on."""
        self._released.set()

    def put_object(self, key: str, payload: bytes) -> None:
        """Store ``payload`` under ``key`` directly (tests, warm-up)."""
        with self._lock:
            self._objects[key] = bytes(payload)

    def delete(self, key: str) -> None:
        """Remove ``key`` as another worker or the store's own eviction would."""
        with self._lock:
            self._objects.pop(key, None)

    def object(self, key: str) -> bytes | None:
        """The stored bytes of ``key``, or None."""
        with self._lock:
            return self._objects.get(key)

    @property
    def pool(self) -> torch.Tensor | None:
        """The buffer registered with ``register_buffer`` (a cache's pool), None before. O(1)."""
        return self._pool

    # -- GlobalStore --
    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register the pool (a contiguous uint8 CPU tensor)."""
        if buffer.dtype is not torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise InvalidArgumentError("register a contiguous 1-D uint8 tensor")
        if self._pool is not None and self._pool is not buffer:
            raise InvalidArgumentError(
                "a pool is already registered with this FaultInjectingStore: give each cache its"
                " own"
            )
        self._pool = buffer

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored."""
        with self._lock:
            self._check_open()
            self.calls["exists"] += 1
            return [key in self._objects for key in keys]

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Copy each object into the pool; bytes written, ``NOT_FOUND`` or ``BUFFER_TOO_SMALL``."""
        return self._transfer("get_into", keys, offsets, sizes, self._get_one)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Copy each pool range into an object; 0 on success."""
        return self._transfer("put_from", keys, offsets, sizes, self._put_one)

    def put_copies(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[int]:
        """Store a copy of each contiguous CPU tensor's bytes (``CopyingStore``); faults as
        for ``put_from``; 0 on success (a stored key keeps its object)."""
        if len(keys) != len(values):
            raise InvalidArgumentError("keys and values must have the same length")
        copies = [v.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for v in values]

        def put(key: str, n: int, _: int) -> int:
            with self._lock:
                self._objects.setdefault(key, copies[n])
            return 0

        return self._transfer("put_copies", keys, range(len(keys)), [len(c) for c in copies], put)

    def get_copies(self, keys: Sequence[str], sizes: Sequence[int]) -> list[torch.Tensor | None]:
        """A new uint8 tensor of each object stored with exactly ``size`` bytes, else None
        (``CopyingStore``); faults as for ``get_into`` (a code: None)."""
        got: list[torch.Tensor | None] = [None] * len(keys)

        def get(key: str, n: int, size: int) -> int:
            with self._lock:
                payload = self._objects.get(key)
            if payload is None or len(payload) != size:
                return NOT_FOUND
            got[n] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            return size

        self._transfer("get_copies", keys, range(len(keys)), sizes, get)
        return got

    def classify(self, code: int) -> TransferOutcome:
        """``NOT_FOUND``, ``BUFFER_TOO_SMALL`` and ``CLOSED`` are FAILED; anything else UNKNOWN."""
        if code in (NOT_FOUND, BUFFER_TOO_SMALL, CLOSED):
            return TransferOutcome.FAILED
        return TransferOutcome.UNKNOWN

    def fence(self) -> None:
        """Release held transfers and return once none is in flight."""
        self._released.set()
        with self._idle:
            self.calls["fence"] += 1
            self._idle.wait_for(lambda: self._in_flight == 0)

    def close(self) -> None:
        """Refuse later calls; objects are dropped."""
        self.fence()
        with self._lock:
            self._closed = True
            self._objects.clear()

    # -- internals --
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the store is closed")

    def _transfer(
        self,
        name: str,
        keys: Sequence[str],
        offsets: Sequence[int],
        sizes: Sequence[int],
        one: Callable[[str, int, int], int],
    ) -> list[int]:
        if not len(keys) == len(offsets) == len(sizes):
            raise InvalidArgumentError("keys, offsets and sizes must have the same length")
        with self._lock:
            if self._closed:
                return [CLOSED] * len(keys)
            self.calls[name] += 1
            self._in_flight += 1
            faults = [self._faults.get(k) for k in keys]
        try:
            if Fault.RAISE in faults:
                raise InjectedError(f"injected failure in {name} for {list(keys)}")
            if Fault.DELAY in faults:
                time.sleep(self._delay)
            if Fault.HOLD in faults:
                self._released.wait()
            return [
                self._faulty(fault, size)
                if fault not in (None, Fault.DELAY, Fault.HOLD)
                else one(key, offset, size)
                for key, offset, size, fault in zip(keys, offsets, sizes, faults, strict=True)
            ]
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    @staticmethod
    def _faulty(fault: Fault, size: int) -> int:
        if fault is Fault.FAIL:
            return NOT_FOUND
        if fault is Fault.SHORT:
            return max(0, size - 1)
        return TIMED_OUT

    def _pool_range(self, offset: int, size: int) -> torch.Tensor:
        if self._pool is None:
            raise InvalidArgumentError("register_buffer must be called before any transfer")
        return self._pool[offset : offset + size]

    def _get_one(self, key: str, offset: int, size: int) -> int:
        with self._lock:
            payload = self._objects.get(key)
        if payload is None:
            return NOT_FOUND
        if len(payload) > size:
            return BUFFER_TOO_SMALL
        if not payload:
            return 0
        target = self._pool_range(offset, len(payload))
        target.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return len(payload)

    def _put_one(self, key: str, offset: int, size: int) -> int:
        payload = self._pool_range(offset, size).numpy().tobytes()
        with self._lock:
            self._objects.setdefault(key, payload)
        return 0
