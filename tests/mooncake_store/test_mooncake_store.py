"""``MooncakeStore`` against a real ``mooncake_master`` on loopback TCP (no mocks).

Two stores with two pools play two encode workers. The module shares one pair of workers
(setting a client up and closing it costs about a second each); every test uses keys of its
own. Tests that kill the master get a master of their own.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

from embcache.driver.global_store import GlobalStore, TransferOutcome, get_outcome, put_outcome
from embcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StoreConfigError,
    StoreUnavailableError,
)
from embcache.store import mooncake as mooncake_module
from embcache.store.mooncake import CODES, MooncakeStore, StoreCode
from tests.support.helpers import payload, unique

if TYPE_CHECKING:
    from embcache.store.mooncake_master import MooncakeMaster

POOL_BYTES = 64 << 20
SEGMENT_BYTES = 256 << 20
OK, FAILED, UNKNOWN = TransferOutcome.OK, TransferOutcome.FAILED, TransferOutcome.UNKNOWN

mooncake = pytest.mark.mooncake
pytestmark = pytest.mark.timeout(60)


def make_store(master: MooncakeMaster, **overrides: object) -> MooncakeStore:
    kwargs: dict[str, object] = {
        **master.store_kwargs(),
        "global_segment_size": SEGMENT_BYTES,
        "reconnect_interval_s": 0.2,
    }
    kwargs.update(overrides)
    return MooncakeStore(**kwargs)  # type: ignore[arg-type]


class Worker:
    """A store and the pool registered with it."""

    def __init__(self, store: MooncakeStore, pool_bytes: int = POOL_BYTES) -> None:
        self.store = store
        self.pool = torch.zeros(pool_bytes, dtype=torch.uint8)
        store.register_buffer(self.pool)

    def write(self, offset: int, payload: torch.Tensor) -> int:
        """Copy ``payload``'s bytes into the pool at ``offset``; return their count."""
        raw = payload.contiguous().view(-1).view(torch.uint8)
        self.pool[offset : offset + raw.numel()] = raw
        return raw.numel()


@pytest.fixture(scope="module")
def workers(mooncake_master: MooncakeMaster) -> Iterator[tuple[Worker, Worker]]:
    """Worker A and worker B, both lending a segment to the store, both connected."""
    with make_store(mooncake_master) as a, make_store(mooncake_master) as b:
        a.connect()
        b.connect()
        yield Worker(a), Worker(b)


# -- round trips ------------------------------------------------------------------------------


@mooncake
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_between_two_workers_is_byte_identical(
    workers: tuple[Worker, Worker], dtype: torch.dtype
) -> None:
    a, b = workers
    shapes = [(1,), (7, 3), (577, 1024), (2, 64, 3584)]
    tensors = [payload(shape, dtype, seed) for seed, shape in enumerate(shapes)]
    keys = [unique(f"rt-{dtype}") for _ in shapes]
    offsets, sizes, at = [], [], 0
    for tensor in tensors:
        offsets.append(at)
        sizes.append(a.write(at, tensor))
        at += (sizes[-1] + 255) // 256 * 256
    assert [put_outcome(a.store, c) for c in a.store.put_from(keys, offsets, sizes)] == [OK] * 4

    b_offsets = [offset + 4096 for offset in offsets]  # other places in the other pool
    got = b.store.get_into(keys, b_offsets, sizes)
    assert [get_outcome(b.store, c, n) for c, n in zip(got, sizes, strict=True)] == [OK] * 4
    for tensor, offset, size in zip(tensors, b_offsets, sizes, strict=True):
        loaded = b.pool[offset : offset + size].view(dtype).view(tensor.shape)
        assert loaded.dtype == tensor.dtype
        assert torch.equal(loaded.view(torch.uint8), tensor.view(torch.uint8))


@mooncake
@pytest.mark.parametrize(
    ("stored", "removed", "asked", "code", "untouched"),
    [
        (None, False, 1024, -704, True),  # never put: OBJECT_NOT_FOUND
        (1000, False, 999, -600, True),  # an object larger than the range: fails
        (1000, False, 2000, 1000, False),  # smaller: a short read (its 1000 bytes land)
        (4096, True, 4096, -704, True),  # removed between exists and get_into
    ],
    ids=["missing key", "object larger than the range", "object smaller", "removed key"],
)
def test_a_read_that_cannot_fill_its_range_fails(
    workers: tuple[Worker, Worker],
    stored: int | None,
    removed: bool,
    asked: int,
    code: int,
    untouched: bool,
) -> None:
    """``get_into`` of ``asked`` bytes of an object of ``stored`` bytes (None: never put; removed
    after ``exists`` saw it) answers ``code``, the outcome FAILED; where the read fails outright
    it writes nothing into the range."""
    a, b = workers
    key = unique("unreadable")
    if stored is not None:
        a.pool[:stored] = 1
        assert a.store.put_from([key], [0], [stored]) == [0]
    if removed:
        assert b.store.exists([key]) == [True]
        assert a.store.remove([key], force=True) == [0]
    span = max(asked, stored or 0)
    b.pool[:span] = 9
    [got] = b.store.get_into([key], [0], [asked])
    assert got == code
    assert get_outcome(b.store, got, asked) is FAILED
    if untouched:
        assert bool((b.pool[:span] == 9).all())


@mooncake
def test_exists(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    stored, missing = unique("stored"), unique("missing")
    assert a.store.put_from([stored], [0], [4096]) == [0]
    assert b.store.exists([stored, missing, "", stored]) == [True, False, False, True]
    assert b.store.exists([]) == []


@mooncake
def test_put_skips_keys_already_stored(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    old, new = unique("old"), unique("new")
    a.pool[:4096] = 1
    assert a.store.put_from([old], [0], [4096]) == [0]
    a.pool[:8192] = 2
    assert a.store.put_from([old, new], [0, 4096], [4096, 4096]) == [0, 0]
    assert b.store.get_into([old, new], [0, 4096], [4096, 4096]) == [4096, 4096]
    assert bool((b.pool[:4096] == 1).all()), "a stored object must not be overwritten"
    assert bool((b.pool[4096:8192] == 2).all())


@mooncake
def test_key_prefix_separates_namespaces(
    mooncake_master: MooncakeMaster, workers: tuple[Worker, Worker]
) -> None:
    a, _ = workers
    key = unique("namespaced")
    assert a.store.put_from([key], [0], [256]) == [0]
    with make_store(mooncake_master, key_prefix="other/", global_segment_size=0) as other:
        assert other.exists([key]) == [False]
        assert a.store.exists([key]) == [True]


@mooncake
def test_bad_items_fail_alone(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    key = unique("good")
    assert a.store.put_from([key], [0], [512]) == [0]
    keys = [key, "", key, key, key]
    offsets = [0, 0, POOL_BYTES - 100, -1, 0]
    sizes = [512, 512, 512, 512, 0]
    got = b.store.get_into(keys, offsets, sizes)
    assert got == [512] + [StoreCode.BAD_ITEM] * 4
    assert all(b.store.classify(code) is FAILED for code in got[1:])
    with pytest.raises(InvalidArgumentError, match="differ in length"):
        b.store.get_into([key], [0, 1], [512])


@mooncake
def test_concurrent_transfers_from_several_threads(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    threads, per_thread, size = 4, 8, 64 << 10
    a.pool[: threads * per_thread * size] = torch.randint(
        0, 256, (threads * per_thread * size,), dtype=torch.uint8
    )
    keys = [unique("conc") for _ in range(threads * per_thread)]
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            mine = range(t * per_thread, (t + 1) * per_thread)
            ks, offs = [keys[i] for i in mine], [i * size for i in mine]
            assert a.store.put_from(ks, offs, [size] * per_thread) == [0] * per_thread
            assert b.store.get_into(ks, offs, [size] * per_thread) == [size] * per_thread
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert not errors, errors
    n = threads * per_thread * size
    assert torch.equal(a.pool[:n], b.pool[:n])


# -- fence --------------------------------------------------------------------------------------


@mooncake
def test_fence_then_transfers_still_work(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    before, after = unique("before-fence"), unique("after-fence")
    a.pool[:8192] = 5
    assert a.store.put_from([before], [0], [4096]) == [0]
    b.store.fence()
    a.store.fence()
    assert a.store.put_from([after], [4096], [4096]) == [0]
    assert b.store.get_into([before, after], [0, 4096], [4096, 4096]) == [4096, 4096]
    assert bool((b.pool[:8192] == 5).all())


@mooncake
def test_fence_waits_for_running_calls_and_loses_none(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    size, count = 1 << 20, 16
    keys = [unique("fence-load") for _ in range(count)]
    assert a.store.put_from(keys, [i * size for i in range(count)], [size] * count) == [0] * count
    results: list[list[int]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            results.append(b.store.get_into(keys, [i * size for i in range(count)], [size] * count))

    loader = threading.Thread(target=load)
    loader.start()
    try:
        for _ in range(2):
            b.store.fence()
    finally:
        stop.set()
        loader.join()
    assert results  # each call ran on the old client or the new one, never on a closed one
    assert all(codes == [size] * count for codes in results), results


# -- the master goes away -----------------------------------------------------------------------


@mooncake
@pytest.mark.timeout(90)
def test_master_killed_mid_batch_fails_items_then_store_reconnects(
    private_mooncake_master: MooncakeMaster,
) -> None:
    master = private_mooncake_master
    size, count = 4 << 20, 12
    with make_store(master) as store_a, make_store(master) as store_b:
        a, b = Worker(store_a), Worker(store_b)
        a.pool[: size * count] = torch.randint(0, 256, (size * count,), dtype=torch.uint8)
        keys = [unique("kill") for _ in range(count)]
        offsets = [i * size for i in range(count)]
        assert a.store.put_from(keys, offsets, [size] * count) == [0] * count

        batches: list[list[int]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def load() -> None:
            try:
                while not stop.is_set():
                    b.pool[: size * count] = 0
                    codes = b.store.get_into(keys, offsets, [size] * count)
                    for code, offset in zip(codes, offsets, strict=True):
                        if code == size:  # served: the bytes must be the stored ones
                            assert torch.equal(
                                b.pool[offset : offset + size], a.pool[offset : offset + size]
                            )
                    batches.append(codes)
            except BaseException as exc:
                errors.append(exc)

        loader = threading.Thread(target=load)
        loader.start()
        try:
            time.sleep(0.3)
            master.kill()
            time.sleep(1.0)
        finally:
            stop.set()
            loader.join(timeout=30)
        assert not loader.is_alive(), "a store call hung after the master died"
        assert not errors, errors
        outcomes = {get_outcome(b.store, code, size) for codes in batches for code in codes}
        assert outcomes <= {OK, FAILED}, f"codes seen: {sorted({c for x in batches for c in x})}"
        assert FAILED in outcomes, "the master died but no item failed"

        started = time.monotonic()
        assert b.store.get_into(keys[:1], [0], [size]) != [size]
        with pytest.raises(StoreUnavailableError, match="MASTER_UNREACHABLE"):
            b.store.exists(keys)
        assert time.monotonic() - started < 1.0, "a call with the master down must fail fast"

        master.start()  # a new master has no objects: put again, then load again
        deadline = time.monotonic() + 30
        while a.store.put_from(keys, offsets, [size] * count) != [0] * count:
            assert time.monotonic() < deadline, "worker A never reconnected"
            time.sleep(0.2)
        while b.store.get_into(keys, offsets, [size] * count) != [size] * count:
            assert time.monotonic() < deadline, "worker B never reconnected"
            time.sleep(0.2)
        assert torch.equal(b.pool[: size * count], a.pool[: size * count])


@mooncake
@pytest.mark.timeout(60)
def test_store_started_before_master_connects_later(
    private_mooncake_master: MooncakeMaster,
) -> None:
    master = private_mooncake_master
    master.kill()
    with make_store(master, global_segment_size=0) as store:
        started = time.monotonic()
        worker = Worker(store, 1 << 20)
        with pytest.raises(StoreUnavailableError, match="NOT_CONNECTED"):
            store.exists(["x"])
        assert store.get_into(["x"], [0], [16]) == [StoreCode.NOT_CONNECTED]
        store.fence()
        with pytest.raises(StoreUnavailableError, match="refuses connections"):
            store.connect()
        assert time.monotonic() - started < 5, "an absent master must not block the caller"

        master.start()
        with make_store(master) as lender:  # this store lends no memory: another one must
            lender.connect()
            key = unique("late")
            worker.pool[:16] = 3
            deadline = time.monotonic() + 20
            while store.put_from([key], [0], [16]) != [0]:
                assert time.monotonic() < deadline, "the store never connected"
                time.sleep(0.1)
            worker.pool[:16] = 0
            assert store.get_into([key], [0], [16]) == [16]
            assert bool((worker.pool[:16] == 3).all())


class RaisingOnce:
    """A real Mooncake client whose next ``batch_get_into`` raises (the binding misbehaving)."""

    def __init__(self, client: object) -> None:
        self._client = client
        self.armed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def batch_get_into(self, *args: object) -> object:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected binding failure")
        return self._client.batch_get_into(*args)  # type: ignore[attr-defined]


@mooncake
def test_a_raising_binding_call_fails_its_items_unknown_and_nothing_else(
    mooncake_master: MooncakeMaster,
) -> None:
    clients: list[RaisingOnce] = []
    real_factory = pytest.importorskip("mooncake.store").MooncakeDistributedStore

    def factory() -> RaisingOnce:
        clients.append(RaisingOnce(real_factory()))
        return clients[-1]

    with make_store(mooncake_master, client_factory=factory) as store:
        worker = Worker(store, 1 << 20)
        key = unique("raising")
        assert store.put_from([key], [0], [4096]) == [0]
        clients[-1].armed = True
        got = store.get_into([key, key], [0, 4096], [4096, 4096])
        assert got == [StoreCode.BINDING_ERROR] * 2
        assert store.classify(got[0]) is UNKNOWN
        store.fence()  # what the cache does before it frees the quarantined ranges
        assert store.get_into([key], [8192], [4096]) == [4096]
        assert torch.equal(worker.pool[8192 : 8192 + 4096], worker.pool[:4096])


# -- codes and lifecycle --------------------------------------------------------------------


CLASSIFY_TABLE = [
    (0, OK),
    (-10, FAILED),  # BUFFER_OVERFLOW
    (-200, FAILED),  # NO_AVAILABLE_HANDLE
    (-600, FAILED),  # INVALID_PARAMS: buffer too small
    (-703, FAILED),  # REPLICA_IS_NOT_READY
    (-704, FAILED),  # OBJECT_NOT_FOUND
    (-705, FAILED),  # OBJECT_ALREADY_EXISTS
    (-706, FAILED),  # OBJECT_HAS_LEASE
    (-707, FAILED),  # LEASE_EXPIRED: checked after the transfer completed
    (-900, FAILED),  # RPC_FAIL: before submit or after join
    (-1, UNKNOWN),  # INTERNAL_ERROR
    (-500, UNKNOWN),  # WRITE_FAIL
    (-800, UNKNOWN),  # TRANSFER_FAIL: may be a timeout with bytes still moving
    (-1000, UNKNOWN),  # ETCD_OPERATION_ERROR: not in the table
    (-12345, UNKNOWN),  # never heard of
    (StoreCode.NOT_CONNECTED, FAILED),
    (StoreCode.STORE_CLOSED, FAILED),
    (StoreCode.NO_BUFFER, FAILED),
    (StoreCode.BAD_ITEM, FAILED),
    (StoreCode.MASTER_UNREACHABLE, FAILED),
    (StoreCode.BINDING_ERROR, UNKNOWN),
]


@pytest.fixture
def offline_store() -> Iterator[MooncakeStore]:
    """A valid store aimed at a port nobody listens on: it never connects."""
    pytest.importorskip("mooncake.store")
    with MooncakeStore("127.0.0.1:9", metadata_server="P2PHANDSHAKE", connect_timeout_s=0.2) as s:
        yield s


@pytest.mark.parametrize(("code", "outcome"), CLASSIFY_TABLE)
def test_classify_table(offline_store: MooncakeStore, code: int, outcome: TransferOutcome) -> None:
    assert offline_store.classify(code) is outcome


def test_code_table_names_are_unique(offline_store: MooncakeStore) -> None:
    names = [info.name for info in CODES.values()]
    assert len(names) == len(set(names))
    assert isinstance(offline_store, GlobalStore)


def test_store_without_master_fails_items_fast(offline_store: MooncakeStore) -> None:
    started = time.monotonic()
    pool = torch.zeros(4096, dtype=torch.uint8)
    offline_store.register_buffer(pool)
    offline_store.register_buffer(pool)  # the same pool again: a no-op
    with pytest.raises(InvalidArgumentError, match="different pool"):
        offline_store.register_buffer(torch.zeros(4096, dtype=torch.uint8))
    assert offline_store.get_into(["k"], [0], [16]) == [StoreCode.NOT_CONNECTED]
    assert offline_store.put_from(["k"], [0], [16]) == [StoreCode.NOT_CONNECTED]
    with pytest.raises(StoreUnavailableError, match="could not check 2 keys"):
        offline_store.exists(["k", "j", ""])
    assert offline_store.exists([""]) == [False]
    offline_store.fence()
    assert time.monotonic() - started < 3
    offline_store.close()
    offline_store.close()
    assert offline_store.get_into(["k"], [0], [16]) == [StoreCode.STORE_CLOSED]


@pytest.mark.parametrize(
    ("buffer", "error"),
    [
        (bytearray(16), InvalidTypeError),
        (torch.zeros(16, dtype=torch.float32), InvalidArgumentError),
        (torch.zeros(0, dtype=torch.uint8), InvalidArgumentError),
        (torch.zeros(4, 4, dtype=torch.uint8).t(), InvalidArgumentError),
    ],
)
def test_register_buffer_rejects_what_is_not_a_pool(
    offline_store: MooncakeStore, buffer: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        offline_store.register_buffer(buffer)  # type: ignore[arg-type]
    assert offline_store.get_into(["k"], [0], [16]) == [StoreCode.NO_BUFFER]


def test_transfers_before_register_buffer_fail(offline_store: MooncakeStore) -> None:
    assert offline_store.get_into(["k"], [0], [16]) == [StoreCode.NO_BUFFER]
    assert offline_store.put_from(["k"], [0], [16]) == [StoreCode.NO_BUFFER]


# -- configuration ---------------------------------------------------------------------------

GOOD = {"master_address": "127.0.0.1:50051"}
BAD_CONFIGS = [
    ({}, "no Mooncake master address"),
    ({"master_address": "localhost"}, r"master_address='localhost' is not host:port"),
    ({"master_address": "host:0"}, "port in 1..65535"),
    ({"master_address": "host:99999"}, "port in 1..65535"),
    ({**GOOD, "metadata_server": "localhost:8080"}, "is not a metadata server"),
    ({**GOOD, "metadata_server": "http://127.0.0.1/metadata"}, "URL with a port"),
    ({**GOOD, "protocol": "udp"}, r"protocol='udp' is not supported: use 'tcp' or 'rdma'"),
    ({**GOOD, "protocol": "rdma"}, "protocol 'rdma' needs an RDMA device"),
    ({**GOOD, "protocol": "rdma", "device_name": "mlx5 0"}, "needs an RDMA device"),
    ({**GOOD, "local_hostname": ""}, "is not a host name"),
    ({**GOOD, "local_hostname": "my host"}, "is not a host name"),
    ({**GOOD, "global_segment_size": -1}, "out of range"),
    ({**GOOD, "global_segment_size": 100}, "out of range: give 0 or 1024"),
    ({**GOOD, "global_segment_size": "lots"}, "'lots' is not a size"),
    ({**GOOD, "global_segment_size": 1.5}, "is not a size"),
    ({**GOOD, "global_segment_size": True}, "is not a size"),
    ({**GOOD, "local_buffer_size": "2PB"}, "is not a size"),
    ({**GOOD, "local_buffer_size": 2 << 40}, "out of range"),
    ({**GOOD, "key_prefix": 3}, "key_prefix=3 must be a str"),
    ({**GOOD, "connect_timeout_s": 0}, "connect_timeout_s=0 must be > 0"),
    ({**GOOD, "reconnect_interval_s": float("nan")}, "must be a finite number"),
]


def _no_binding() -> None:
    raise AssertionError("validation must happen before any network probe")


@pytest.mark.parametrize(("kwargs", "message"), BAD_CONFIGS)
def test_bad_config_raises_before_import_or_network(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], message: str
) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    # importing Mooncake fails: the config is checked before it
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    monkeypatch.setattr(mooncake_module, "reachable", _no_binding)
    with pytest.raises(StoreConfigError, match=message):
        MooncakeStore(**kwargs)  # type: ignore[arg-type]


BAD_ENV = [
    ({"MOONCAKE_MASTER": "nonsense"}, r"\$MOONCAKE_MASTER='nonsense' is not host:port"),
    ({**{"MOONCAKE_MASTER": "h:1"}, "MOONCAKE_PROTOCOL": "ib"}, r"\$MOONCAKE_PROTOCOL='ib'"),
    ({"MOONCAKE_MASTER": "h:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4 XB"}, "is not a size"),
    ({"MOONCAKE_MASTER": "h:1", "MOONCAKE_TE_META_DATA_SERVER": "ftp://h:2"}, "metadata server"),
]


@pytest.mark.parametrize(("env", "message"), BAD_ENV)
def test_bad_environment_raises_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    # importing Mooncake fails: the environment is checked before it
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StoreConfigError, match=message):
        MooncakeStore()


def test_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mooncake.store")
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.5:50051")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://10.0.0.5:8080/metadata")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "RDMA")
    monkeypatch.setenv("MOONCAKE_DEVICE", "mlx5_0,mlx5_1")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.7")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4GB")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "0")
    config = MooncakeStore().config
    assert (config.master_host, config.master_port) == ("10.0.0.5", 50051)
    assert config.metadata_probe == ("10.0.0.5", 8080)
    assert (config.protocol, config.device_name) == ("rdma", "mlx5_0,mlx5_1")
    assert config.local_hostname == "10.0.0.7"
    assert (config.global_segment_size, config.local_buffer_size) == (4 << 30, 0)
    explicit = MooncakeStore("h:1", protocol="tcp", global_segment_size=0).config
    assert (explicit.master_address, explicit.protocol, explicit.device_name) == ("h:1", "tcp", "")
    assert explicit.global_segment_size == 0


def test_missing_extra_names_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(StoreUnavailableError) as info:
        MooncakeStore("127.0.0.1:50051")
    message = str(info.value)
    assert "pip install 'embcache[mooncake]'" in message
    assert "mooncake-transfer-engine-non-cuda" in message
    assert "mooncake-transfer-engine (the CUDA build)" in message
