"""Overlapping fences, shared by the tests, the trace generator and the trace tests.

``LimboStore`` holds each store fence until the test lets it through, and keeps UNKNOWN reads in
flight: one lands garbage in its range when the first store fence that began after it returns.
``requarantine_between_fences`` runs the issue's schedule on a cache built on such a store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from embcache import EmbeddingCache, Item, TransferOutcome
from embcache.core.lifecycle import ABSENT, QUARANTINED
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import FenceThread, payload, wait_until

UNIT = 256
WAIT_S = 60.0  # bounds waits that end at once (long: loaded CI machines)
GARBAGE = 0xAB


class LimboStore(FaultInjectingStore):
    """An ``FaultInjectingStore`` whose fences return only when the test opens their gate, and whose
    UNKNOWN reads are still in flight: each lands garbage in its range when the first store
    fence that began after it returns (the latest moment the protocol allows)."""

    def __init__(self) -> None:
        super().__init__(delay_seconds=0.0)
        self.limbo: list[tuple[int, int]] = []  # (offset, size) of reads still in flight
        self.gates: list[threading.Event] = []  # one per fence call, in call order
        self.open = False  # once set, fences no longer wait
        self._cv = threading.Condition()

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        codes = super().get_into(keys, offsets, sizes)
        with self._cv:
            for offset, size, code in zip(offsets, sizes, codes, strict=True):
                if code < 0 and self.classify(code) is TransferOutcome.UNKNOWN:
                    self.limbo.append((offset, size))
        return codes

    def fence(self) -> None:
        gate = threading.Event()
        with self._cv:
            covered, self.limbo = self.limbo, []  # what was in flight when this fence began
            self.gates.append(gate)
            self._cv.notify_all()
        if not self.open:
            assert gate.wait(WAIT_S), "a store fence was never let through"
        assert self.pool is not None
        for offset, size in covered:
            self.pool[offset : offset + size] = GARBAGE
        super().fence()

    def wait_fences(self, n: int) -> None:
        """Wait until ``n`` store fences have begun."""
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.gates) >= n, WAIT_S), "no fence began"

    def let_through(self, index: int) -> None:
        self.gates[index].set()

    def open_all(self) -> None:
        with self._cv:
            self.open = True
            for gate in self.gates:
                gate.set()


def tensor(seed: int) -> torch.Tensor:
    return payload((UNIT // 4,), torch.float32, seed)


def item(key: str) -> Item:
    return Item(key, (UNIT // 4,), torch.float32)


def quarantine_by_load(cache: EmbeddingCache, store: LimboStore, key: str) -> None:
    """Load ``key`` from the store; the read ends UNKNOWN and stays in limbo."""
    store.inject(key, Fault.UNKNOWN)
    with cache.request(f"load-{key}") as request:
        request.lookup([item(key)])
        assert request.wait(WAIT_S)
    assert cache.entry_state(key) is QUARANTINED


def requarantine_between_fences(cache: EmbeddingCache, store: LimboStore, *, manual: bool) -> int:
    """Fences A and B both snapshot ``k`` (QUARANTINED); A ends and frees it; ``k`` is loaded
    again and QUARANTINED again by a read B does not cover; then B ends. Returns what B freed.
    A is a manual ``fence()`` (``manual``) or the cache's own (its fencer must be eager)."""
    quarantine_by_load(cache, store, "k")
    a = FenceThread(cache, WAIT_S) if manual else None  # else the fencer begins it by itself
    store.wait_fences(1)
    b = FenceThread(cache, WAIT_S)
    store.wait_fences(2)  # both fences snapshotted k
    store.let_through(0)  # fence A ends: k is freed
    wait_until(lambda: cache.entry_state("k") is ABSENT, "fence A to free k")
    if a is not None:
        assert a.join() == 1
    quarantine_by_load(cache, store, "k")  # k again, QUARANTINED by a read B does not cover
    store.let_through(1)
    return b.join()
