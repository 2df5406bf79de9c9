"""``FleetClaims``' order of events on a real ``mooncake_master``, two workers in one process.

Worker A and worker B each have a cache on their own ``MooncakeStore`` (A's store also lends
the memory). ``Recorder`` wraps a real store and records the claim calls and the answers of
``exists`` in order (an observer, not a double: every call reaches Mooncake).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.pipeline import FleetClaims
from embcache.store.mooncake import MooncakeStore

if TYPE_CHECKING:
    from embcache.store.mooncake_master import MooncakeMaster

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]

SHAPE = (4, 16)


class Recorder:
    """A real ``MooncakeStore`` whose claim calls and ``exists`` answers are recorded."""

    def __init__(self, store: MooncakeStore) -> None:
        self.store = store
        self.events: list[tuple[str, str, object]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    @property
    def claim_lease_s(self) -> float:
        return self.store.claim_lease_s

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self.store.register_buffer(buffer)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        return self.store.get_into(keys, offsets, sizes)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        return self.store.put_from(keys, offsets, sizes)

    def classify(self, code: int) -> Any:
        return self.store.classify(code)

    def fence(self) -> None:
        self.store.fence()

    def close(self) -> None:
        self.store.close()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        found = self.store.exists(keys)
        self._record("exists", keys, found)
        return found

    def claim(self, keys: Sequence[str]) -> list[int]:
        codes = self.store.claim(keys)
        self._record("claim", keys, codes)
        return codes

    def release(self, keys: Sequence[str]) -> list[int]:
        codes = self.store.release(keys)
        self._record("release", keys, codes)
        return codes

    def _record(self, what: str, keys: Sequence[str], answers: Sequence[object]) -> None:
        with self._lock:
            self.events += [(what, k, a) for k, a in zip(keys, answers, strict=True)]


class Encoder:
    """Each key's embedding: rows of ``len(key)``; counts the keys it encodes."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def __call__(self, keys: Sequence[str], /) -> list[torch.Tensor]:
        self.encoded += keys
        return [torch.full(SHAPE, float(len(k))) for k in keys]


class Worker:
    def __init__(self, master: MooncakeMaster, prefix: str, segment: int) -> None:
        self.store = Recorder(
            MooncakeStore(**master.store_kwargs(), key_prefix=prefix, global_segment_size=segment)
        )
        self.store.store.connect()
        self.cache = EmbeddingCache(4 << 20, store=self.store, pin_memory=False)
        self.claims = FleetClaims(self.store, lease_s=5.0, poll_s=0.005)  # type: ignore[arg-type]
        self.encoder = Encoder()
        self.pipeline = EncodePipeline(self.cache, self.encoder, claims=self.claims)

    def close(self) -> None:
        self.claims.close()
        self.cache.close()
        self.store.close()


@pytest.fixture
def pair(mooncake_master: MooncakeMaster, key_prefix: str) -> Iterator[tuple[Worker, Worker]]:
    a = Worker(mooncake_master, key_prefix, 64 << 20)
    b = Worker(mooncake_master, key_prefix, 0)
    yield a, b
    b.close()
    a.close()


def item(key: str) -> Item:
    return Item(key, SHAPE, torch.float32)


def test_a_claim_is_released_only_after_its_publish_is_visible(pair: tuple[Worker, Worker]) -> None:
    a, _ = pair
    out = a.pipeline.encode("r", [item("img")], ["img"])
    assert torch.equal(out, torch.full(SHAPE, 3.0))
    deadline = time.monotonic() + 5
    while not any(e[0] == "release" for e in a.store.events):
        assert time.monotonic() < deadline, a.store.events
        time.sleep(0.01)
    events = a.store.events
    released = next(n for n, e in enumerate(events) if e[:2] == ("release", "img"))
    assert ("exists", "img", True) in events[:released], events
    assert a.claims.stats().released == 1 and a.claims.stats().expired == 0


def test_a_claim_won_after_another_workers_publish_and_release_loads_instead_of_encoding(
    pair: tuple[Worker, Worker],
) -> None:
    a, b = pair
    with b.cache.lookup("late", [item("late-img")], reserve_misses=True)[0] as request:
        a.pipeline.encode("r", [item("late-img")], ["late-img"])  # A claims, publishes ...
        deadline = time.monotonic() + 5
        while a.claims.stats().released < 1:  # ... and releases after B's lookup
            assert time.monotonic() < deadline
            time.sleep(0.01)
        mine, waiting = b.claims.claim(["late-img"])
        assert (mine, waiting) == ([], ["late-img"]), "won, but the key is stored: not B's"
        settled = b.claims.wait(request, [item("late-img")])
        assert settled.loaded == ["late-img"] and settled.mine == []
        (view,) = request.embeddings()
        assert view is not None and torch.equal(view, torch.full(SHAPE, 8.0))
    assert b.encoder.encoded == [] and a.encoder.encoded == ["late-img"]
