"""A claimed key's fresh output that the claimer's pool did not take is still published, as a
copy put into the store (``FleetClaims.publish_copies``, a ``CopyingStore``'s ``put_copies``).

Workers are threads, each with its own cache, ``EncodePipeline`` and ``FleetClaims``, on the
in-process master of ``tests/support/claim_store.py`` (the real-master tests of the same
behaviour: ``tests/mooncake_store/test_mooncake_claim_order.py``). The claimer's pool holds one
entry and its policy admits nothing that must evict, so once it holds another key it refuses
every insert (``not_admitted``), as the adaptive policy refuses a scan's one-off images.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.core.lifecycle import EntryState
from embcache.driver.global_store import CopyingStore
from embcache.errors import InvalidArgumentError, InvalidTypeError
from embcache.pipeline import FleetClaims
from embcache.store.mooncake import MooncakeStore
from embcache.testing import Fault, FaultInjectingStore
from tests.support.claim_store import Client, Master
from tests.support.helpers import DEVICES, AdmitsNothing, GatedEncoder

pytestmark = pytest.mark.timeout(60)

SHAPE = (4, 16)  # 256 bytes: one aligned entry
LEASE_S = 5.0


def item(key: str) -> Item:
    return Item(key, SHAPE, torch.float32)


def value(key: str) -> torch.Tensor:
    return torch.full(SHAPE, float(len(key)))



class NoCopies(Client):
    """A claiming store that cannot copy (not a ``CopyingStore``)."""

    put_copies = None  # type: ignore[assignment]


class FailingCopies(Client):
    """A store whose copies all fail, as with no space in the global store."""

    def put_copies(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[int]:
        return [-200] * len(keys)


class Worker:
    def __init__(self, store: Client, *, refuses: bool = False, device: str = "cpu") -> None:
        self.store = store
        policy: Any = AdmitsNothing() if refuses else "lru"
        self.cache = EmbeddingCache(256 if refuses else 1 << 20, store=store, pin_memory=False,
                                    policy=policy)  # fmt: skip
        self.claims = FleetClaims(store, lease_s=LEASE_S, poll_s=0.005)  # type: ignore[arg-type]
        self.encoder = GatedEncoder(SHAPE, device)
        self.pipeline = EncodePipeline(self.cache, self.encoder, claims=self.claims)
        if refuses:  # the one entry its pool holds: every later insert must evict, refused
            self.encode("filler")
            self.encoder.encoded.clear()

    def encode(self, key: str) -> torch.Tensor:
        return self.pipeline.encode(f"r-{key}", [item(key)], [key])

    def close(self) -> None:
        self.claims.close()
        self.cache.close()


@pytest.fixture
def make_worker() -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(store: Client, **kw: Any) -> Worker:
        made.append(Worker(store, **kw))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_waiter_loads_the_output_the_claimers_pool_refused(
    make_worker: Callable[..., Worker],
) -> None:
    master = Master(LEASE_S)
    a = make_worker(Client(master, "a"), refuses=True)
    b = make_worker(Client(master, "b"))
    a.encoder.gate = threading.Event()
    a.encoder.entered.clear()
    answers: dict[str, torch.Tensor] = {}
    claimer = threading.Thread(target=lambda: answers.update(a=a.encode("x")))
    claimer.start()
    assert a.encoder.entered.wait(5), "a claims x and encodes it"
    waiter = threading.Thread(target=lambda: answers.update(b=b.encode("x")))
    waiter.start()
    until(lambda: b.claims.stats().waited == 1, "b finds a's claim and waits")
    a.encoder.gate.set()
    claimer.join(10)
    waiter.join(10)
    assert torch.equal(answers["a"], value("x")) and torch.equal(answers["b"], value("x"))
    assert a.cache.entry_state("x") is EntryState.ABSENT, "a's pool refused x"
    assert a.pipeline.stats().fallbacks_by_reason["not_admitted"] == 1
    assert a.encoder.encoded == ["x"] and b.encoder.encoded == [], "encoded once in the fleet"
    assert b.claims.stats().loaded == 1 and b.claims.stats().taken_over == 0
    assert a.claims.stats().copied == 1


def test_a_refused_output_is_stored_then_its_claim_released_and_a_later_miss_loads_it(
    make_worker: Callable[..., Worker],
) -> None:
    master = Master(LEASE_S)
    a = make_worker(Client(master, "a"), refuses=True)
    b = make_worker(Client(master, "b"))
    assert torch.equal(a.encode("y"), value("y"))
    assert master.objects["y"] == value("y").numpy().tobytes(), "the encoder's bytes, stored"
    until(lambda: a.claims.stats().released == 2, "the claim ends once y is stored")
    assert "y" not in master.claims and a.claims.stats().expired == 0
    assert torch.equal(b.encode("y"), value("y"))
    assert b.encoder.encoded == [], "a store hit: not encoded again"


def test_a_waiter_whose_pool_refuses_reads_a_copy_of_the_claimers_publish(
    make_worker: Callable[..., Worker],
) -> None:
    master = Master(LEASE_S)
    a = make_worker(Client(master, "a"))
    b = make_worker(Client(master, "b"), refuses=True)
    a.encoder.gate = threading.Event()
    a.encoder.entered.clear()
    answers: dict[str, torch.Tensor] = {}
    claimer = threading.Thread(target=lambda: answers.update(a=a.encode("w")))
    claimer.start()
    assert a.encoder.entered.wait(5)
    waiter = threading.Thread(target=lambda: answers.update(b=b.encode("w")))
    waiter.start()
    until(lambda: b.claims.stats().waited == 1, "b finds a's claim and waits")
    a.encoder.gate.set()
    claimer.join(10)
    waiter.join(10)
    assert torch.equal(answers["b"], value("w")) and b.encoder.encoded == []
    assert b.cache.entry_state("w") is EntryState.ABSENT, "b's pool never took it"
    assert b.claims.stats().read_copies == 1 and b.claims.stats().loaded == 1


def test_a_stored_key_the_pool_refuses_is_served_from_a_copy_not_encoded(
    make_worker: Callable[..., Worker],
) -> None:
    master = Master(LEASE_S)
    master.objects["s"] = value("s").numpy().tobytes()
    b = make_worker(Client(master, "b"), refuses=True)
    assert torch.equal(b.encode("s"), value("s"))
    assert b.encoder.encoded == [], "the store holds it: read, not encoded"
    assert b.claims.stats().read_copies == 1
    assert b.pipeline.stats().waited == 1, "served like a load"
    until(lambda: "s" not in master.claims, "the claim won before the second look ends")


def test_copies_land_in_their_own_rows_of_a_request_of_several_items(
    make_worker: Callable[..., Worker],
) -> None:
    master = Master(LEASE_S)
    for key in ("s1", "s333"):
        master.objects[key] = value(key).numpy().tobytes()
    b = make_worker(Client(master, "b"), refuses=True)
    keys = ["new22", "s1", "filler", "s333", "new4444"]
    out = b.pipeline.encode("several", [item(k) for k in keys], keys)
    assert torch.equal(out, torch.cat([value(k) for k in keys]))
    assert sorted(b.encoder.encoded) == ["new22", "new4444"], "the stored ones read as copies"
    assert b.claims.stats().read_copies == 2 and b.claims.stats().copied == 2


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_on_the_encoders_device_are_published_and_read_back_as_copies(
    make_worker: Callable[..., Worker], device: str
) -> None:
    master = Master(LEASE_S)
    a = make_worker(Client(master, "a"), refuses=True, device=device)
    b = make_worker(Client(master, "b"), refuses=True, device=device)
    out = a.encode("gpu-key")
    assert out.device.type == device and torch.equal(out.cpu(), value("gpu-key"))
    assert master.objects["gpu-key"] == value("gpu-key").numpy().tobytes(), "copied to host"
    got = b.encode("gpu-key")
    assert got.device.type == device and torch.equal(got.cpu(), value("gpu-key"))
    assert b.encoder.encoded == [] and b.claims.stats().read_copies == 1


@pytest.mark.parametrize("store", [NoCopies, FailingCopies])
def test_a_refused_output_the_store_cannot_copy_ends_its_claim_at_once(
    make_worker: Callable[..., Worker], store: type[Client]
) -> None:
    master = Master(LEASE_S)
    a = make_worker(store(master, "a"), refuses=True)
    assert isinstance(a.store, CopyingStore) is (store is FailingCopies)
    assert torch.equal(a.encode("z"), value("z"))
    assert "z" not in master.objects and "z" not in master.claims, "released, not published"
    assert a.claims.stats().copied == 0
    until(lambda: a.claims.stats().released == 2, "the filler's claim, after its publish")


def test_publish_copies_puts_the_bytes_of_a_non_contiguous_output_in_c_order() -> None:
    master = Master(LEASE_S)
    claims = FleetClaims(Client(master, "a"), lease_s=LEASE_S)  # type: ignore[arg-type]
    out = torch.arange(64, dtype=torch.float32).reshape(16, 4).t()  # (4, 16), not contiguous
    assert claims.claim(["t"]) == (["t"], [])
    claims.publish_copies({"t": out})
    assert master.objects["t"] == out.contiguous().numpy().tobytes()
    until(lambda: "t" not in master.claims, "released once stored")
    claims.close()


def test_publish_copies_rejects_bad_inputs_and_puts_nothing() -> None:
    master = Master(LEASE_S)
    claims = FleetClaims(Client(master, "a"), lease_s=LEASE_S)  # type: ignore[arg-type]
    assert claims.claim(["k"]) == (["k"], [])
    with pytest.raises(InvalidTypeError):
        claims.publish_copies([("k", value("k"))])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        claims.publish_copies({"k": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="no claim"):
        claims.publish_copies({"k": value("k"), "never-claimed": value("n")})
    claims.publish_copies({})
    assert master.objects == {} and "k" in master.claims, "nothing put, the claim still held"
    claims.publish_copies({"k": value("k")})
    with pytest.raises(InvalidArgumentError, match="no claim"):
        claims.publish_copies({"k": value("k")})  # published already
    claims.close()


def test_fault_injecting_store_copies_and_keeps_a_stored_keys_object() -> None:
    store = FaultInjectingStore()
    assert isinstance(store, CopyingStore)
    assert store.put_copies(["p", "q"], [value("p"), torch.ones(3, dtype=torch.bfloat16)]) == [0, 0]
    assert store.put_copies(["p"], [torch.zeros(SHAPE)]) == [0]
    assert store.object("p") == value("p").numpy().tobytes(), "the first put stays"
    ones = torch.ones(3, dtype=torch.bfloat16)
    assert store.object("q") == ones.view(torch.uint8).numpy().tobytes()
    store.inject("f", Fault.FAIL)
    assert store.put_copies(["f"], [value("f")])[0] < 0 and store.object("f") is None
    with pytest.raises(InvalidArgumentError):
        store.put_copies(["p", "q"], [value("p")])
    p, short, missing, failed = store.get_copies(["p", "q", "m", "f"], [256, 5, 4, 4])
    assert p is not None and torch.equal(p.view(torch.float32).view(SHAPE), value("p"))
    assert short is None and missing is None and failed is None


def test_mooncake_put_copies_rejects_malformed_calls_before_any_store_call() -> None:
    def no_client() -> Any:
        raise AssertionError("no client may be made")

    store = MooncakeStore("127.0.0.1:1", client_factory=no_client)
    assert isinstance(store, CopyingStore)
    with pytest.raises(InvalidArgumentError):
        store.put_copies(["a", "b"], [value("a")])
    with pytest.raises(InvalidArgumentError):
        store.put_copies("ab", [value("a"), value("b")])
    with pytest.raises(InvalidTypeError):
        store.put_copies(["a"], [b"bytes"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="contiguous CPU"):
        store.put_copies(["a"], [value("a").t()])
    with pytest.raises(InvalidArgumentError, match="contiguous CPU"):
        store.put_copies(["a"], [torch.empty(SHAPE, device="meta")])
    with pytest.raises(InvalidArgumentError):
        store.get_copies(["a", "b"], [4])
    with pytest.raises(InvalidArgumentError):
        store.get_copies("ab", [4, 4])
    store.close()
