"""The bad-input catalogue: every public entry point, each bad input it must refuse.

Each row calls one public API with one bad input and names the exact ``embcache.errors`` type
and a fragment of the message it must raise. Around every row the test checks that nothing
changed: the cache's ``stats()`` (but ``oldest_pin_age_s``), every entry's state, what the
requests hold, the allocator's blocks, the store's objects, calls and registered pool, and that
``check_invariants()`` holds before and after. ``tests/test_cache.py`` and
``tests/test_allocator.py`` keep their own narrower bad-input tests; this file is the catalogue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item, Request
from embcache.driver.allocator import RangeAllocator
from embcache.errors import (
    ClosedError,
    EmbCacheError,
    InvalidArgumentError,
    InvalidTypeError,
    NotAllocatedError,
    RequestError,
    StoreConfigError,
)
from embcache.store.mooncake import MooncakeStore
from embcache.testing import FaultInjectingStore

pytestmark = pytest.mark.timeout(60)

T = torch.zeros(16, 16)
SLOT = Item("held", (256,), torch.float32)
KEYS = ["idle", "held", "reserved", "k", "fresh"]
MASTER = "127.0.0.1:1"  # never contacted: config validation comes first


class Encoder:
    """A valid pipeline encoder (never called by these rows)."""

    device = torch.device("cpu")

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        raise AssertionError("a bad input reached the encoder")


@dataclasses.dataclass
class World:
    """A cache with an idle, a held and a reserved entry (and a request waiting on it); a closed
    request, a closed cache and
    a request opened on it before it closed; an allocator with live blocks; a pipeline; a
    closed store."""

    cache: EmbeddingCache
    store: FaultInjectingStore
    holder: Request
    filler: Request
    waiter: Request
    closed_request: Request
    closed_cache: EmbeddingCache
    stale: Request
    allocator: RangeAllocator
    pipeline: EncodePipeline
    closed_store: FaultInjectingStore


def snapshot(w: World) -> tuple[Any, ...]:
    def frozen(cache: EmbeddingCache) -> Any:
        return dataclasses.replace(cache.stats(), oldest_pin_age_s=0.0)

    return (
        frozen(w.cache),
        frozen(w.closed_cache),
        [w.cache.entry_state(k) for k in KEYS],
        w.holder.fallback_mask().tolist(),
        w.filler.fallback_mask().tolist(),
        w.waiter.fallback_mask().tolist(),
        w.allocator.allocations(),
        w.allocator.free_blocks(),
        dict(w.store.calls),
        [w.store.object(k) for k in KEYS],
        w.store.pool is w.cache.pool,  # the pool the test double transfers into
        w.pipeline.stats().calls,
    )


def check_invariants(w: World) -> None:
    w.cache.check_invariants()
    w.closed_cache.check_invariants()
    w.allocator.check_invariants()


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    for variable in [name for name in os.environ if name.startswith("MOONCAKE_")]:
        monkeypatch.delenv(variable)
    store = FaultInjectingStore()
    cache = EmbeddingCache(1 << 16, store=store, pin_memory=False)
    with cache.request("setup") as setup:
        setup.insert(["idle", "held"], [torch.ones(256), torch.full((256,), 2.0)], publish=True)
    holder = cache.request("holder")
    holder.lookup([SLOT])
    filler = cache.request("filler")
    filler.lookup([Item("reserved", (16, 16), torch.float32)], reserve_misses=True)
    waiter = cache.request("waiter")
    waiter.lookup([Item("reserved", (16, 16), torch.float32)])
    closed_request = cache.request("closed")
    closed_request.close()
    closed_cache = EmbeddingCache(4096, pin_memory=False)
    stale = closed_cache.request("stale")
    closed_cache.close()
    allocator = RangeAllocator(8192, 256)
    for size in (256, 1000, 512):
        allocator.allocate(size)
    allocator.free(256)  # a hole in the middle
    closed_store = FaultInjectingStore()
    closed_store.close()
    deadline = time.monotonic() + 10
    while cache.stats().publishes_ok < 2:  # let the publishes land before any snapshot
        assert time.monotonic() < deadline, cache.stats()
        time.sleep(0.001)
    w = World(
        cache,
        store,
        holder,
        filler,
        waiter,
        closed_request,
        closed_cache,
        stale,
        allocator,
        EncodePipeline(cache, Encoder(), prefetch_timeout=1.0),
        closed_store,
    )
    yield w
    for request in (holder, filler, waiter, stale):
        request.close()
    cache.close()


Row = tuple[Callable[[World], object], type[EmbCacheError], str]
CATALOGUE: dict[str, Row | Any] = {  # Any: a pytest.param row carrying a bug mark
    # ---------------------------------------------------------------- RangeAllocator
    "allocator: zero capacity": (
        lambda w: RangeAllocator(0),
        InvalidArgumentError,
        "capacity must be > 0, got 0",
    ),
    "allocator: str capacity": (
        lambda w: RangeAllocator("4096"),  # type: ignore[arg-type]
        InvalidTypeError,
        "capacity must be an int, got str",
    ),
    "allocator: capacity not a multiple of the alignment": (
        lambda w: RangeAllocator(1000, 256),
        InvalidArgumentError,
        "capacity 1000 must be a multiple of the alignment 256",
    ),
    "allocator: alignment not a power of two": (
        lambda w: RangeAllocator(4096, 96),
        InvalidArgumentError,
        "power of two > 0, got 96",
    ),
    "allocator: allocate 0 bytes": (
        lambda w: w.allocator.allocate(0),
        InvalidArgumentError,
        "nbytes must be > 0, got 0",
    ),
    "allocator: allocate more than the capacity": (
        lambda w: w.allocator.allocate(8193),
        InvalidArgumentError,
        "8193",
    ),
    "allocator: allocate a float": (
        lambda w: w.allocator.allocate(256.0),  # type: ignore[arg-type]
        InvalidTypeError,
        "nbytes must be an int",
    ),
    "allocator: allocate a bool": (
        lambda w: w.allocator.allocate(True),
        InvalidTypeError,
        "nbytes must be an int",
    ),
    "allocator: free the hole": (
        lambda w: w.allocator.free(256),
        NotAllocatedError,
        "256",
    ),
    "allocator: free inside a block": (
        lambda w: w.allocator.free(512),
        NotAllocatedError,
        "512",
    ),
    "allocator: free a str offset": (
        lambda w: w.allocator.free("0"),  # type: ignore[arg-type]
        InvalidTypeError,
        "offset must be an int",
    ),
    # ---------------------------------------------------------------- EmbeddingCache()
    "cache: zero capacity": (
        lambda w: EmbeddingCache(0, pin_memory=False),
        InvalidArgumentError,
        "capacity must be > 0",
    ),
    "cache: alignment below 16": (
        lambda w: EmbeddingCache(4096, alignment=8, pin_memory=False),
        InvalidArgumentError,
        "alignment must be >= 16",
    ),
    "cache: zero eviction batch": (
        lambda w: EmbeddingCache(4096, max_eviction_batch=0, pin_memory=False),
        InvalidArgumentError,
        "max_eviction_batch must be > 0, got 0",
    ),
    "cache: float io_workers": (
        lambda w: EmbeddingCache(4096, io_workers=2.0, pin_memory=False),  # type: ignore[arg-type]
        InvalidTypeError,
        "io_workers must be an int",
    ),
    "cache: not a store": (
        lambda w: EmbeddingCache(4096, store=object(), pin_memory=False),  # type: ignore[arg-type]
        InvalidTypeError,
        "store must implement GlobalStore, got object",
    ),
    "cache: bad capacity with a store already in use": (
        lambda w: EmbeddingCache(1000, store=w.store, pin_memory=False),
        InvalidArgumentError,
        "multiple of the alignment",
    ),
    # ---------------------------------------------------------------- EmbeddingCache methods
    "cache.request: int id": (
        lambda w: w.cache.request(3),  # type: ignore[arg-type]
        InvalidTypeError,
        "request_id must be a str, got 3",
    ),
    "cache.request: empty id": (
        lambda w: w.cache.request(""),
        InvalidArgumentError,
        "request_id must be a non-empty str",
    ),
    "cache.request: id already open": (
        lambda w: w.cache.request("holder"),
        RequestError,
        "request 'holder' is already open",
    ),
    "cache.remove: empty key": (
        lambda w: w.cache.remove(""),
        InvalidArgumentError,
        "key must be a non-empty str",
    ),
    "cache.remove: None key": (
        lambda w: w.cache.remove(None),  # type: ignore[arg-type]
        InvalidTypeError,
        "key must be a str, got NoneType",
    ),
    "cache.entry_state: bytes key": (
        lambda w: w.cache.entry_state(b"idle"),  # type: ignore[arg-type]
        InvalidTypeError,
        "key must be a str, got bytes",
    ),
    "cache.entry_states: bytes key after a good one": (
        lambda w: w.cache.entry_states(["idle", b"idle"]),  # type: ignore[list-item]
        InvalidTypeError,
        "key must be a str, got bytes",
    ),
    "closed cache: request": (
        lambda w: w.closed_cache.request("x"),
        ClosedError,
        "the cache is closed",
    ),
    "closed cache: remove": (
        lambda w: w.closed_cache.remove("k"),
        ClosedError,
        "the cache is closed",
    ),
    "closed cache: clear": (
        lambda w: w.closed_cache.clear(),
        ClosedError,
        "the cache is closed",
    ),
    "closed cache: fence": (
        lambda w: w.closed_cache.fence(),
        ClosedError,
        "the cache is closed",
    ),
    # ---------------------------------------------------------------- Request
    "lookup: a str instead of an Item": (
        lambda w: w.holder.lookup(["idle"]),  # type: ignore[list-item]
        InvalidTypeError,
        "lookup takes a sequence of Item",
    ),
    "lookup: a bare Item": (
        lambda w: w.holder.lookup(SLOT),  # type: ignore[arg-type]
        InvalidTypeError,
        "lookup takes a sequence of Item",
    ),
    "lookup: a tuple after a valid Item": (
        lambda w: w.holder.lookup([SLOT, ("k", (4,))]),  # type: ignore[list-item]
        InvalidTypeError,
        "lookup takes a sequence of Item",
    ),
    "insert: fewer tensors than keys": (
        lambda w: w.holder.insert(["a", "b"], [T]),
        InvalidArgumentError,
        "as many tensors",
    ),
    "insert: keys as one str": (
        lambda w: w.holder.insert("ab", [T, T]),
        InvalidArgumentError,
        "a list of keys",
    ),
    "insert: a list instead of a tensor": (
        lambda w: w.holder.insert(["k"], [[1.0, 2.0]]),  # type: ignore[list-item]
        InvalidTypeError,
        "expected a torch.Tensor for 'k', got list",
    ),
    "insert: empty key": (
        lambda w: w.holder.insert([""], [T]),
        InvalidArgumentError,
        "key must be a non-empty str",
    ),
    "insert: 0-d tensor": (
        lambda w: w.holder.insert(["k"], [torch.tensor(1.0)]),
        InvalidTypeError,
        "shape must be a non-empty tuple",
    ),
    "insert: empty tensor": (
        lambda w: w.holder.insert(["k"], [torch.empty(0, 4)]),
        InvalidArgumentError,
        "shape dims must be > 0",
    ),
    "insert: reservation filled with another shape": (
        lambda w: w.filler.insert(["reserved"], [torch.zeros(8, 32)]),
        InvalidArgumentError,
        "reserved as (16, 16) torch.float32",
    ),
    "insert: reservation filled with another dtype, after a fresh key": (
        lambda w: w.filler.insert(["fresh", "reserved"], [T, T.half()]),
        InvalidArgumentError,
        "reserved as",
    ),
    "wait: a str timeout": (
        lambda w: w.holder.wait("soon"),  # type: ignore[arg-type]
        InvalidTypeError,
        "timeout",
    ),
    "wait: a negative timeout": (
        lambda w: w.waiter.wait(-1.0),
        InvalidArgumentError,
        "timeout must be >= 0 seconds, got -1.0",
    ),
    "wait: a NaN timeout": (
        lambda w: w.waiter.wait(math.nan),
        InvalidArgumentError,
        "timeout must be >= 0 seconds, got nan",
    ),
    "wait_async: a str timeout": (
        lambda w: asyncio.run(w.waiter.wait_async("soon")),  # type: ignore[arg-type]
        InvalidTypeError,
        "timeout must be a number of seconds or None, got 'soon'",
    ),
    "closed request: lookup": (
        lambda w: w.closed_request.lookup([SLOT]),
        ClosedError,
        "request 'closed' is closed",
    ),
    "closed request: insert": (
        lambda w: w.closed_request.insert(["k"], [T]),
        ClosedError,
        "request 'closed' is closed",
    ),
    "closed request: embeddings": (
        lambda w: w.closed_request.embeddings(),
        ClosedError,
        "request 'closed' is closed",
    ),
    "closed request: fallback_reasons": (
        lambda w: w.closed_request.fallback_reasons(),
        ClosedError,
        "request 'closed' is closed",
    ),
    "request on a closed cache: lookup": (
        lambda w: w.stale.lookup([SLOT]),
        ClosedError,
        "the cache is closed",
    ),
    # ---------------------------------------------------------------- Item
    "Item: empty key": (
        lambda w: Item("", (4,), torch.float32),
        InvalidArgumentError,
        "key must be a non-empty str",
    ),
    "Item: int key": (
        lambda w: Item(7, (4,), torch.float32),  # type: ignore[arg-type]
        InvalidTypeError,
        "key must be a str, got int",
    ),
    "Item: zero dim": (
        lambda w: Item("k", (0, 4), torch.float32),
        InvalidArgumentError,
        "shape dims must be > 0, got (0, 4)",
    ),
    "Item: list shape": (
        lambda w: Item("k", [4], torch.float32),  # type: ignore[arg-type]
        InvalidTypeError,
        "shape must be a non-empty tuple of ints, got [4]",
    ),
    "Item: float dim": (
        lambda w: Item("k", (4.0,), torch.float32),  # type: ignore[arg-type]
        InvalidTypeError,
        "shape dims must be ints",
    ),
    "Item: str dtype": (
        lambda w: Item("k", (4,), "float32"),  # type: ignore[arg-type]
        InvalidTypeError,
        "dtype must be a torch.dtype, got 'float32'",
    ),
    "Item.of_matrix: int key": (
        lambda w: Item.of_matrix(7, 4, 4, torch.float32),  # type: ignore[arg-type]
        InvalidTypeError,
        "key must be a str, got int",
    ),
    "Item.of_matrix: empty key": (
        lambda w: Item.of_matrix("", 4, 8, torch.float16),
        InvalidArgumentError,
        "key must be a non-empty str",
    ),
    "Item.of_matrix: zero rows": (
        lambda w: Item.of_matrix("k", 0, 8, torch.float16),
        InvalidArgumentError,
        "shape dims must be > 0, got (0, 8)",
    ),
    "Item.of_matrix: bool width": (
        lambda w: Item.of_matrix("k", 4, True, torch.float16),
        InvalidTypeError,
        "shape dims must be ints",
    ),
    "Item.of_matrix: str dtype": (
        lambda w: Item.of_matrix("k", 4, 8, "float16"),  # type: ignore[arg-type]
        InvalidTypeError,
        "dtype must be a torch.dtype, got 'float16'",
    ),
    "Item.of_matrices: int key": (
        lambda w: Item.of_matrices(["k", 7], [4, 4], 4, torch.float32),  # type: ignore[list-item]
        InvalidTypeError,
        "key must be a str, got int",
    ),
    "Item.of_matrices: empty key": (
        lambda w: Item.of_matrices(["k", ""], [4, 4], 8, torch.float16),
        InvalidArgumentError,
        "key must be a non-empty str",
    ),
    "Item.of_matrices: zero rows": (
        lambda w: Item.of_matrices(["k", "j"], [4, 0], 8, torch.float16),
        InvalidArgumentError,
        "shape dims must be > 0, got (0, 8)",
    ),
    "Item.of_matrices: bool rows": (
        lambda w: Item.of_matrices(["k"], [True], 8, torch.float16),
        InvalidTypeError,
        "shape dims must be ints",
    ),
    "Item.of_matrices: bool width": (
        lambda w: Item.of_matrices(["k"], [4], True, torch.float16),
        InvalidTypeError,
        "shape dims must be ints",
    ),
    "Item.of_matrices: str dtype": (
        lambda w: Item.of_matrices([], [], 8, "float16"),  # type: ignore[arg-type]
        InvalidTypeError,
        "dtype must be a torch.dtype, got 'float16'",
    ),
    "Item.of_matrices: keys a str": (
        lambda w: Item.of_matrices("kj", [4, 4], 8, torch.float16),  # type: ignore[arg-type]
        InvalidTypeError,
        "of_matrices takes keys as a sequence (a list), got str",
    ),
    "Item.of_matrices: keys a generator": (
        lambda w: Item.of_matrices((k for k in "kj"), [4, 4], 8, torch.float16),  # type: ignore[arg-type]
        InvalidTypeError,
        "of_matrices takes keys as a sequence (a list), got generator",
    ),
    "Item.of_matrices: rows an int": (
        lambda w: Item.of_matrices(["k"], 4, 8, torch.float16),  # type: ignore[arg-type]
        InvalidTypeError,
        "of_matrices takes rows as a sequence (a list), got int",
    ),
    "Item.of_matrices: lengths differ": (
        lambda w: Item.of_matrices(["k", "j"], [4], 8, torch.float16),
        InvalidArgumentError,
        "2 keys but 1 row counts",
    ),
    "Item.of: not a tensor": (
        lambda w: Item.of("k", [1.0]),  # type: ignore[arg-type]
        InvalidTypeError,
        "expected a torch.Tensor for 'k', got list",
    ),
    # ---------------------------------------------------------------- FaultInjectingStore
    "FaultInjectingStore: register a float buffer": (
        lambda w: FaultInjectingStore().register_buffer(torch.zeros(16)),
        InvalidArgumentError,
        "contiguous 1-D uint8",
    ),
    "FaultInjectingStore: register a second pool": (
        lambda w: w.store.register_buffer(torch.zeros(4096, dtype=torch.uint8)),
        InvalidArgumentError,
        "already registered",
    ),
    "FaultInjectingStore: lengths differ": (
        lambda w: w.store.get_into(["idle"], [0, 256], [1024]),
        InvalidArgumentError,
        "keys, offsets and sizes must have the same length",
    ),
    "FaultInjectingStore: closed": (
        lambda w: w.closed_store.exists(["idle"]),
        ClosedError,
        "the store is closed",
    ),
    # ---------------------------------------------------------------- MooncakeStore config
    "Mooncake: no master address": (
        lambda w: MooncakeStore(),
        StoreConfigError,
        "no Mooncake master address",
    ),
    "Mooncake: master without a port": (
        lambda w: MooncakeStore("localhost"),
        StoreConfigError,
        "master_address='localhost' is not host:port",
    ),
    "Mooncake: master port out of range": (
        lambda w: MooncakeStore("10.0.0.5:70000"),
        StoreConfigError,
        "port in 1..65535",
    ),
    "Mooncake: metadata server of an unknown scheme": (
        lambda w: MooncakeStore(MASTER, metadata_server="ftp://10.0.0.5:21/x"),
        StoreConfigError,
        "is not a metadata server",
    ),
    "Mooncake: unknown protocol": (
        lambda w: MooncakeStore(MASTER, protocol="udp"),
        StoreConfigError,
        "protocol='udp' is not supported: use 'tcp' or 'rdma'",
    ),
    "Mooncake: rdma without a device": (
        lambda w: MooncakeStore(MASTER, protocol="rdma"),
        StoreConfigError,
        "protocol 'rdma' needs an RDMA device",
    ),
    "Mooncake: segment size with an unknown unit": (
        lambda w: MooncakeStore(MASTER, global_segment_size="12XB"),
        StoreConfigError,
        "global_segment_size='12XB' is not a size",
    ),
    "Mooncake: segment size too small": (
        lambda w: MooncakeStore(MASTER, global_segment_size=10),
        StoreConfigError,
        "global_segment_size=10 is out of range",
    ),
    "Mooncake: zero connect timeout": (
        lambda w: MooncakeStore(MASTER, connect_timeout_s=0),
        StoreConfigError,
        "connect_timeout_s=0 must be > 0 seconds",
    ),
    "Mooncake: host name with a space": (
        lambda w: MooncakeStore(MASTER, local_hostname="my host"),
        StoreConfigError,
        "is not a host name",
    ),
    "Mooncake: key prefix not a str": (
        lambda w: MooncakeStore(MASTER, key_prefix=5),  # type: ignore[arg-type]
        StoreConfigError,
        "key_prefix=5 must be a str",
    ),
    # ---------------------------------------------------------------- EncodePipeline
    "pipeline: encoder without a device": (
        lambda w: EncodePipeline(w.cache, lambda inputs: inputs),  # type: ignore[arg-type]
        InvalidTypeError,
        "encoder must be callable on a list of inputs and have a torch.device",
    ),
    "pipeline: rank 0 without a cache": (
        lambda w: EncodePipeline(None, Encoder()),
        InvalidTypeError,
        "rank 0 needs an EmbeddingCache, got NoneType",
    ),
    "pipeline: zero prefetch timeout": (
        lambda w: EncodePipeline(w.cache, Encoder(), prefetch_timeout=0),
        InvalidArgumentError,
        "prefetch_timeout must be a finite number of seconds > 0, got 0",
    ),
    "pipeline: str collective timeout": (
        lambda w: EncodePipeline(w.cache, Encoder(), collective_timeout="1s"),  # type: ignore[arg-type]
        InvalidTypeError,
        "collective_timeout must be a number of seconds",
    ),
    "pipeline.encode: no items": (
        lambda w: w.pipeline.encode("p", [], []),
        InvalidArgumentError,
        "encode needs at least one item",
    ),
    "pipeline.encode: fewer inputs than items": (
        lambda w: w.pipeline.encode("p", [SLOT, SLOT], [0]),
        InvalidArgumentError,
        "2 items but 1 inputs",
    ),
    "pipeline.encode: a bare Item": (
        lambda w: w.pipeline.encode("p", SLOT, [0]),  # type: ignore[arg-type]
        InvalidTypeError,
        "items must be a sequence of Item, got Item",
    ),
    "pipeline.encode: mixed dtypes": (
        lambda w: w.pipeline.encode("p", [SLOT, Item("k", (256,), torch.float16)], [0, 1]),
        InvalidArgumentError,
        "must share the dtype and every other dim",
    ),
    "pipeline.encode: one key, two shapes": (
        lambda w: w.pipeline.encode(
            "p", [Item("k", (2, 8), torch.float32), Item("k", (3, 8), torch.float32)], [0, 1]
        ),
        InvalidArgumentError,
        "one key names one embedding",
    ),
    "pipeline.encode: request id already open": (
        lambda w: w.pipeline.encode("holder", [SLOT], [0]),
        RequestError,
        "request 'holder' is already open",
    ),
}


def test_the_catalogue_has_at_least_30_rows() -> None:
    assert len(CATALOGUE) >= 30


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        pytest.param(*row.values, marks=row.marks, id=name)
        if hasattr(row, "marks")  # a pytest.param, i.e. a row with a bug mark
        else pytest.param(*row, id=name)
        for name, row in CATALOGUE.items()
    ],
)
def test_bad_input_raises_its_error_and_changes_nothing(
    world: World, call: Callable[[World], object], error: type[EmbCacheError], fragment: str
) -> None:
    check_invariants(world)
    before = snapshot(world)
    with pytest.raises(EmbCacheError) as caught:
        call(world)
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    assert fragment in str(caught.value), str(caught.value)
    assert snapshot(world) == before
    check_invariants(world)
    view = world.holder.embeddings()[0]  # the held entry is still served, unchanged
    assert view is not None and torch.equal(view, torch.full((256,), 2.0))


# ---------------------------------------------------------------- demo CLI
REPO = Path(__file__).resolve().parent.parent


def test_demo_with_an_unknown_option_exits_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "embcache", "demo", "--bad-option"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert "unrecognized arguments: --bad-option" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["demo", "--requests", "0"], "--requests must be >= 1, got 0"),
        (["demo", "--zipf", "-1"], "--zipf must be a finite number >= 0"),
        (["demo", "--store-fault-rate", "1"], "--store-fault-rate must be in [0, 1)"),
        (["demo", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["demo", "--master", "10.0.0.5:1"], "--master and --metadata-server need --store"),
        (["demo", "--plot", "out.svg"], "--plot writes a PNG"),
    ],
)
def test_demo_with_a_bad_option_exits_2_naming_it(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from embcache.__main__ import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert fragment in captured.err, captured.err
    assert captured.out == ""
