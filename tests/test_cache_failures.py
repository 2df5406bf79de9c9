"""One test per failure of the design that ``EmbeddingCache`` replaces.

Each test drives the cache only through its public API with an injectable ``FaultInjectingStore``,
checks that the bytes a request reads are exactly the bytes that were stored, and ends with
``check_invariants()``, no pins left and exact byte accounting. Transfers are kept in flight
deterministically with ``Fault.HOLD`` and ``release_holds()``; nothing sleeps to let things
happen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, Item, Reason, Status
from embcache.core.lifecycle import ABSENT, LOADING, QUARANTINED, READY
from embcache.driver.locks import assert_unlocked, enable_lock_checking, lock_checking_enabled
from embcache.errors import LockOrderError
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import aligned, item_of, payload, raw, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("poison_modes")]

ALIGN = 256
WAIT_S = 10.0


# ---------------------------------------------------------------------------- helpers
def assert_clean(cache: EmbeddingCache, present: Sequence[Item] = ()) -> None:
    """Invariants hold, no pin or request is left, bytes are exactly those of present entries."""
    cache.check_invariants()
    stats = cache.stats()
    assert stats.pinned_entries == 0, stats
    assert stats.pinned_bytes == 0, stats
    assert stats.open_requests == 0, stats
    assert stats.entries_by_state.get("LOADING", 0) == 0, stats
    assert stats.allocated_bytes == sum(stats.bytes_by_state.values()), stats
    assert stats.allocated_bytes + stats.free_bytes == stats.capacity_bytes, stats
    live = [it for it in present if cache.entry_state(it.key) is not ABSENT]
    assert stats.allocated_bytes == sum(aligned(it.nbytes) for it in live), (stats, live)


def read_back(cache: EmbeddingCache, item: Item, request_id: str) -> bytes:
    """Look ``item`` up in a fresh request (loading it if needed) and return the bytes served."""
    with cache.request(request_id) as request:
        statuses = request.lookup([item])
        assert statuses[0].status in (Status.HIT, Status.LOADING), statuses
        assert request.wait(timeout=WAIT_S)
        view = request.embeddings()[0]
        assert view is not None, request.fallback_reasons()
        assert view.dtype == item.dtype and tuple(view.shape) == item.shape
        return raw(view)


class PartialWriteStore(FaultInjectingStore):
    """A store whose reads of ``partial`` keys write garbage into half the range, then say so."""

    def __init__(self) -> None:
        super().__init__()
        self.partial: set[str] = set()
        self._buffer: torch.Tensor | None = None

    def register_buffer(self, buffer: torch.Tensor) -> None:
        super().register_buffer(buffer)
        self._buffer = buffer

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        codes = super().get_into(keys, offsets, sizes)
        assert self._buffer is not None
        for i, (key, offset, size) in enumerate(zip(keys, offsets, sizes, strict=True)):
            if key in self.partial:
                self._buffer[offset : offset + size // 2].fill_(0xAB)
                codes[i] = size // 2
        return codes


# ---------------------------------------------------------------------------- 1
@pytest.mark.parametrize("failure", ["fail", "short", "truncated_object", "partial_write"])
def test_failed_or_partial_read_is_never_served_or_republished(failure: str) -> None:
    """A failed or partial store read frees the entry: never a hit with garbage, never published."""
    store = PartialWriteStore()
    cache = EmbeddingCache(1 << 20, store=store, pin_memory=False)
    try:
        good = payload((32, 16), torch.float32, seed=1)
        item = item_of("img", good)
        if failure == "fail":
            store.put_object("img", raw(good))
            store.inject("img", Fault.FAIL)
        elif failure == "short":
            store.put_object("img", raw(good))
            store.inject("img", Fault.SHORT)
        elif failure == "truncated_object":  # the store really writes fewer bytes than asked
            store.put_object("img", raw(good)[: item.nbytes // 2])
        else:
            store.put_object("img", raw(good))
            store.partial.add("img")

        for attempt in range(2):  # the failure repeats: never a hit on what the first one left
            with cache.request(f"r{attempt}") as request:
                assert request.lookup([item])[0].status is Status.LOADING
                assert request.wait(timeout=WAIT_S)
                assert request.embeddings() == [None]
                assert request.fallback_mask().tolist() == [1]
                assert request.fallback_reasons() == [Reason.LOAD_FAILED]
            assert cache.entry_state("img") is ABSENT
            assert_clean(cache, [item])

        with cache.request("no-prefetch") as request:  # nothing of it is left in the pool
            assert request.lookup([item], prefetch=False)[0].reason is Reason.NOT_FOUND

        store.inject("img", None)
        store.partial.clear()
        store.delete("img")
        store.put_object("img", raw(good))
        assert read_back(cache, item, "after-fix") == raw(good)
        assert read_back(cache, item, "hit") == raw(good)
        assert store.calls["put_from"] == 0  # loaded entries are never (re)published
        assert store.object("img") == raw(good)
        stats = cache.stats()
        assert stats.loads_failed == 2 and stats.loads_ok == 1 and stats.hits == 1, stats
        assert_clean(cache, [item])
    finally:
        store.release_holds()
        cache.close()
        store.close()


# ---------------------------------------------------------------------------- 2
def test_second_request_during_read_waits_and_never_sees_half_written_memory(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """A request that joins a read in flight gets LOADING and no view until the bytes are valid."""
    cache = make_cache()
    data = payload((64, 32), torch.bfloat16, seed=2)
    item = item_of("img", data)
    store.put_object("img", raw(data))
    store.inject("img", Fault.HOLD)

    with cache.request("first") as first, cache.request("second") as second:
        assert first.lookup([item])[0].status is Status.LOADING
        assert second.lookup([item])[0].status is Status.LOADING
        third_statuses = None
        with cache.request("third") as third:  # even without prefetch it joins, never a hit
            third_statuses = third.lookup([item], prefetch=False)
            assert third.embeddings() == [None]
        assert third_statuses[0].status is Status.LOADING
        assert cache.entry_state("img") is LOADING
        assert second.embeddings() == [None]
        assert not second.wait(timeout=0.05)  # still held: the read has not ended
        assert second.embeddings() == [None]
        assert second.fallback_mask().tolist() == [1]

        store.release_holds()
        assert second.wait(timeout=WAIT_S)
        assert first.wait(timeout=WAIT_S)
        for request in (first, second):
            view = request.embeddings()[0]
            assert view is not None
            assert view.dtype == torch.bfloat16 and tuple(view.shape) == item.shape
            assert raw(view) == raw(data)
            assert request.fallback_mask().tolist() == [0]
        assert cache.stats().pinned_entries == 1
    assert store.calls["get_into"] == 1  # one read served every request
    assert cache.stats().single_flight_joins >= 2
    assert_clean(cache, [item])


# ---------------------------------------------------------------------------- 3
def test_no_eviction_between_load_completion_and_the_waiter_reading(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """EndLoad pins every waiter at once: allocation pressure right after it evicts nothing."""
    data = payload((256, 64), torch.float32, seed=3)  # 64 KiB
    item = item_of("loaded", data)
    cache = make_cache(capacity=aligned(item.nbytes) + 4 * ALIGN, policy="lru")
    store.put_object("loaded", raw(data))
    store.inject("loaded", Fault.HOLD)
    big = payload((256, 64), torch.float32, seed=33)  # needs the loaded entry's range

    stop = threading.Event()
    pressure_results: list[bool] = []

    def pressure() -> None:  # other requests keep asking for the range while the load ends
        n = 0
        while not stop.is_set():
            with cache.request(f"pressure-{n}") as request:
                pressure_results.extend(request.insert([f"big-{n}"], [big], publish=False))
            n += 1

    with cache.request("waiter") as waiter:
        assert waiter.lookup([item])[0].status is Status.LOADING
        thread = threading.Thread(target=pressure)
        thread.start()
        try:
            store.release_holds()
            assert waiter.wait(timeout=WAIT_S)
            assert cache.stats().pinned_entries == 1  # pinned by EndLoad itself, before any read
            with cache.request("evictor") as evictor:
                statuses = evictor.lookup([item_of("big", big)], reserve_misses=True)
                assert statuses[0].status is Status.MISS
                assert statuses[0].reason is Reason.NO_SPACE
            view = waiter.embeddings()[0]
            assert view is not None
            assert raw(view) == raw(data)
        finally:
            stop.set()
            thread.join(WAIT_S)
        assert not thread.is_alive()
        assert not any(pressure_results)
        assert cache.stats().evictions == 0
        assert cache.entry_state("loaded") is READY
        assert raw(view) == raw(data)  # still intact after all that pressure
    assert_clean(cache, [item])

    with cache.request("after") as request:  # once released it is evictable as usual
        assert request.insert(["big"], [big], publish=False) == [True]
    assert cache.entry_state("loaded") is ABSENT
    assert cache.stats().evictions == 1
    assert read_back(cache, item_of("big", big), "read-big") == raw(big)
    assert_clean(cache, [item, item_of("big", big)])


# ---------------------------------------------------------------------------- 4
def test_one_failed_item_does_not_hold_up_the_request(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """A batch with one failing item ends at once; the mask marks exactly that item."""
    cache = make_cache()
    tensors = {f"img{i}": payload((16, 32), torch.float16, seed=40 + i) for i in range(5)}
    items = [item_of(k, t) for k, t in tensors.items()]
    for key, tensor in tensors.items():
        store.put_object(key, raw(tensor))
    store.inject("img2", Fault.FAIL)
    with cache.request("warm") as warm:  # img0 becomes a pool hit, the rest load from the store
        warm.lookup([items[0]])
        assert warm.wait(timeout=WAIT_S)

    with cache.request("r") as request:
        start = time.monotonic()
        statuses = request.lookup(items)
        assert [s.status for s in statuses] == [Status.HIT] + [Status.LOADING] * 4
        assert request.wait(timeout=30)
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, elapsed
        assert request.fallback_mask().tolist() == [0, 0, 1, 0, 0]
        assert request.fallback_reasons()[2] is Reason.LOAD_FAILED
        views = request.embeddings()
        assert views[2] is None
        for key, view in zip(tensors, views, strict=True):
            if key != "img2":
                assert view is not None and raw(view) == raw(tensors[key])
    assert cache.entry_state("img2") is ABSENT
    assert_clean(cache, items)


# ---------------------------------------------------------------------------- 5
def test_an_exception_in_the_io_worker_does_not_kill_later_loads(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """A raising store call fails its items (UNKNOWN); the one I/O worker keeps serving."""
    cache = make_cache(io_workers=1)
    tensors = {f"img{i}": payload((8, 64), torch.float32, seed=50 + i) for i in range(6)}
    for key, tensor in tensors.items():
        store.put_object(key, raw(tensor))
    store.inject("img0", Fault.RAISE)
    items = {k: item_of(k, t) for k, t in tensors.items()}

    with cache.request("raising") as request:
        assert request.lookup([items["img0"]])[0].status is Status.LOADING
        assert request.wait(timeout=WAIT_S)
        assert request.fallback_mask().tolist() == [1]
        assert request.fallback_reasons() == [Reason.LOAD_UNKNOWN]
    assert cache.entry_state("img0") is QUARANTINED  # the raising call may still touch it

    fresh = payload((8, 64), torch.float32, seed=59)
    store.inject("pub", Fault.RAISE)
    with cache.request("publisher") as request:  # a raising publish on the same worker
        assert request.insert(["pub"], [fresh], publish=True) == [True]
        wait_until(lambda: cache.stats().publishes_unknown == 1, "the raising publish")
    assert cache.entry_state("pub") is QUARANTINED

    for n, key in enumerate(["img1", "img2", "img3", "img4", "img5"]):  # one batch at a time
        assert read_back(cache, items[key], f"later-{n}") == raw(tensors[key])
    with cache.request("batch") as request:
        request.lookup(list(items.values())[1:])
        assert request.wait(timeout=WAIT_S)
        assert request.fallback_mask().tolist() == [0] * 5
    stats = cache.stats()
    assert stats.loads_unknown == 1 and stats.loads_ok == 5, stats
    assert_clean(cache, [*items.values(), item_of("pub", fresh)])

    assert cache.fence() == 2
    assert cache.entry_state("img0") is ABSENT and cache.entry_state("pub") is ABSENT
    store.inject("img0", None)
    assert read_back(cache, items["img0"], "after-fence") == raw(tensors["img0"])
    assert_clean(cache, [*items.values(), item_of("pub", fresh)])


# ---------------------------------------------------------------------------- 6
class CopyFailed(RuntimeError):
    pass


class FailingCopy(torch.Tensor):
    """An encoder output whose copy into the pool raises part-way through a batch."""

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__name__", "") == "copy_":
            raise CopyFailed("injected failure while copying into the pool")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_exception_part_way_through_a_batch_insert_leaks_nothing(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """A copy that raises mid-batch frees its range and the rest; leaving the request unpins."""
    cache = make_cache()
    good = {k: payload((16, 16), torch.float32, seed=60 + i) for i, k in enumerate("abcd")}
    bad = payload((16, 16), torch.float32, seed=69).as_subclass(FailingCopy)
    items = {k: item_of(k, t) for k, t in good.items()}
    items["bad"] = Item("bad", (16, 16), torch.float32)

    with cache.request("waiter") as waiter:
        with pytest.raises(CopyFailed), cache.request("encoder") as encoder:
            statuses = encoder.lookup([items["b"], items["c"]], reserve_misses=True)
            assert [s.status for s in statuses] == [Status.RESERVED] * 2
            assert waiter.lookup([items["c"]])[0].status is Status.LOADING
            encoder.insert(
                ["a", "b", "bad", "c", "d"], [good["a"], good["b"], bad, good["c"], good["d"]]
            )
        assert waiter.wait(timeout=WAIT_S)  # its reservation ended with the failure
        assert waiter.fallback_mask().tolist() == [1]
        assert waiter.embeddings() == [None]
    assert [cache.entry_state(k) for k in ("a", "b", "bad", "c", "d")] == [
        READY,
        READY,
        ABSENT,
        ABSENT,
        ABSENT,
    ]
    assert_clean(cache, list(items.values()))
    assert cache.stats().allocated_bytes == 2 * aligned(items["a"].nbytes)
    assert read_back(cache, items["a"], "read-a") == raw(good["a"])
    assert read_back(cache, items["b"], "read-b") == raw(good["b"])
    with cache.request("retry") as request:  # the failed keys can be inserted again
        assert request.insert(["c", "d"], [good["c"], good["d"]], publish=False) == [True, True]
    assert read_back(cache, items["c"], "read-c") == raw(good["c"])
    assert_clean(cache, list(items.values()))


# ---------------------------------------------------------------------------- 7
def test_a_release_only_ever_drops_its_own_pin(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """Requests release only what they hold, however often they close or reuse an id."""
    data = payload((128, 64), torch.float32, seed=7)  # 32 KiB: the pool holds exactly one
    item = item_of("img", data)
    other = payload((128, 64), torch.float32, seed=77)
    cache = make_cache(capacity=aligned(item.nbytes))
    with cache.request("filler") as request:
        assert request.insert(["img"], [data], publish=False) == [True]

    owner = cache.request("owner")
    borrower = cache.request("borrower")
    assert owner.lookup([item, item])[0].status is Status.HIT  # one pin for both occurrences
    assert borrower.lookup([item])[0].status is Status.HIT
    assert owner.lookup([item])[0].status is Status.HIT  # a second lookup adds no pin
    owner.close()
    cache.check_invariants()  # the pin dropped was the owner's own (PinsExact)
    owner.close()  # idempotent
    with cache.request("owner") as reused:  # the id of a former holder holds nothing
        assert reused.insert(["img"], [other], publish=False) == [False]  # present: left alone
    cache.check_invariants()
    with cache.request("looker") as looker:  # looked the key up but got no pin
        assert looker.lookup([Item("img", (64, 128), torch.float32)])[0].reason is (Reason.MISMATCH)
    cache.check_invariants()
    with cache.request("stranger"):
        pass
    cache.check_invariants()

    assert cache.stats().pinned_entries == 1  # the borrower's pin survived all of that
    with cache.request("evictor") as evictor:
        statuses = evictor.lookup([item_of("other", other)], reserve_misses=True)
        assert statuses[0].reason is Reason.NO_SPACE
    assert cache.remove("img")  # busy: doomed, not freed under the borrower
    with cache.request("late") as late:
        assert late.lookup([item])[0].reason is Reason.BUSY
    cache.check_invariants()
    view = borrower.embeddings()[0]
    assert view is not None and raw(view) == raw(data)
    assert cache.entry_state("img") is READY
    assert cache.stats().evictions == 0
    borrower.close()
    assert cache.entry_state("img") is ABSENT  # the last pin freed the doomed entry
    assert_clean(cache, [item])


# ---------------------------------------------------------------------------- 8
UNIT = 1024  # bytes per slot: 256 float32


def unit_tensor(units: int, seed: int) -> torch.Tensor:
    return payload((units * UNIT // 4,), torch.float32, seed)


def fill_slots(cache: EmbeddingCache, keys: str) -> dict[str, torch.Tensor]:
    """Insert one-unit entries, which land in address order in an empty pool."""
    tensors = {k: unit_tensor(1, seed=80 + i) for i, k in enumerate(keys)}
    for key, tensor in tensors.items():
        with cache.request(f"fill-{key}") as request:
            assert request.insert([key], [tensor], publish=False) == [True]
    return tensors


def age_in_order(cache: EmbeddingCache, keys: str) -> None:
    """Make ``keys`` the LRU order (oldest first) by releasing a hit on each in turn."""
    for key in keys:
        with cache.request(f"touch-{key}") as request:
            assert request.lookup([Item(key, (UNIT // 4,), torch.float32)])[0].status is Status.HIT


def test_eviction_frees_only_adjacent_victims(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """LRU order A, C, B, D and a two-slot request: plain LRU would evict A and C (not
    adjacent) for nothing; the rule evicts exactly A and B and keeps C."""
    trace: list[dict[str, Any]] = []
    cache = make_cache(capacity=4 * UNIT, trace=trace, policy="lru")
    tensors = fill_slots(cache, "ABCD")
    age_in_order(cache, "ACBD")
    before = cache.stats().evictions
    new = unit_tensor(2, seed=88)
    with cache.request("two-slots") as request:
        statuses = request.lookup([item_of("new", new)], reserve_misses=True)
        assert statuses[0].status is Status.RESERVED
        assert request.insert(["new"], [new], publish=False) == [True]
    evicted = [e["key"] for e in trace if e["action"] == "Evict"]
    assert evicted == ["A", "B"]
    assert cache.stats().evictions == before + 2
    assert cache.stats().evicted_bytes == 2 * UNIT
    for key in "CD":
        assert read_back(cache, item_of(key, tensors[key]), f"read-{key}") == raw(tensors[key])
    assert read_back(cache, item_of("new", new), "read-new") == raw(new)
    assert_clean(cache, [*(item_of(k, t) for k, t in tensors.items()), item_of("new", new)])


def test_eviction_evicts_nothing_when_no_contiguous_run_exists(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """With B and D pinned, the free-able A and C are not adjacent: no eviction, MISS(no_space)."""
    cache = make_cache(capacity=4 * UNIT)
    tensors = fill_slots(cache, "ABCD")
    age_in_order(cache, "ACBD")
    items = {k: item_of(k, t) for k, t in tensors.items()}
    new = unit_tensor(2, seed=89)
    with cache.request("pins") as pins:
        assert [s.status for s in pins.lookup([items["B"], items["D"]])] == [Status.HIT] * 2
        before = cache.stats()
        with cache.request("two-slots") as request:
            statuses = request.lookup([item_of("new", new)], reserve_misses=True)
            assert statuses[0].status is Status.MISS
            assert statuses[0].reason is Reason.NO_SPACE
            assert request.insert(["new"], [new], publish=False) == [False]
            assert request.fallback_mask().tolist() == [1]
        after = cache.stats()
        assert after.evictions == before.evictions
        assert after.evicted_bytes == before.evicted_bytes
        assert after.allocation_failures_by_reason.get("no_space", 0) >= 1
        assert after.allocated_bytes == 4 * UNIT
    for key in "ABCD":
        assert cache.entry_state(key) is READY
        assert read_back(cache, items[key], f"read-{key}") == raw(tensors[key])
    assert_clean(cache, list(items.values()))


# ---------------------------------------------------------------------------- 9
@pytest.mark.parametrize("shape", [(64, 3584), (3, 5), (1, 7, 129)])
def test_bf16_entries_take_bf16_bytes_and_read_back_as_bf16(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache], shape: tuple[int, ...]
) -> None:
    """A bf16 entry uses its own bytes (rounded to the alignment), for inserts and for loads."""
    cache = make_cache(capacity=4 << 20)
    inserted = payload(shape, torch.bfloat16, seed=9)
    loaded = payload(shape, torch.bfloat16, seed=99)
    size = aligned(inserted.numel() * 2)

    with cache.request("encoder") as request:
        assert request.insert(["ins"], [inserted], publish=False) == [True]
    stats = cache.stats()
    assert stats.allocated_bytes == size
    assert stats.bytes_by_state == {"READY": size}
    store.put_object("load", raw(loaded))
    assert read_back(cache, item_of("load", loaded), "load") == raw(loaded)
    assert cache.stats().allocated_bytes == 2 * size

    with cache.request("reader") as request:
        request.lookup([item_of("ins", inserted), item_of("load", loaded)])
        views = request.embeddings()
        for view, expected in zip(views, (inserted, loaded), strict=True):
            assert view is not None
            assert view.dtype == torch.bfloat16
            assert tuple(view.shape) == shape
            assert view.element_size() * view.numel() == expected.numel() * 2
            assert raw(view) == raw(expected)
            assert torch.equal(view, expected)
        fp32 = request.lookup([Item("ins", shape, torch.float32)])  # never a converted view
        assert fp32[0].reason is Reason.MISMATCH
    assert_clean(cache, [item_of("ins", inserted), item_of("load", loaded)])


# ---------------------------------------------------------------------------- 10
class ProbeStore(FaultInjectingStore):
    """Runs ``probe`` inside every transfer, where the payload bytes move."""

    def __init__(self) -> None:
        super().__init__()
        self.probe: Callable[[str], None] = lambda where: None
        self.put_done = threading.Event()

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self.probe("get_into")
        return super().get_into(keys, offsets, sizes)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self.probe("put_from")
        try:
            return super().put_from(keys, offsets, sizes)
        finally:
            self.put_done.set()


def test_no_lock_is_held_during_payload_copies() -> None:
    """While an insert copy, a store read or a publish moves bytes, another thread can look up,
    read and take stats, and the copying thread holds no lock (the lock-order checker's record
    of the locks each thread holds, turned on for the test)."""
    was = lock_checking_enabled()
    enable_lock_checking(True)
    try:
        copies_hold_no_lock()
    finally:
        enable_lock_checking(was)


def copies_hold_no_lock() -> None:
    store = ProbeStore()
    cache = EmbeddingCache(64 << 20, store=store, pin_memory=False)
    try:
        resident = payload((64, 64), torch.float32, seed=100)
        resident_item = item_of("resident", resident)
        with cache.request("setup") as request:
            assert request.insert(["resident"], [resident], publish=False) == [True]
        probes: list[tuple[str, bool, bool, bytes]] = []

        def probe(where: str) -> None:
            try:
                assert_unlocked(where)
                lock_free = True
            except LockOrderError:
                lock_free = False
            served: list[bytes] = []

            def concurrent_reader() -> None:
                with cache.request(f"concurrent-{len(probes)}") as request:
                    assert request.lookup([resident_item])[0].status is Status.HIT
                    view = request.embeddings()[0]
                    assert view is not None
                    served.append(raw(view))
                cache.stats()
                cache.check_invariants()

            thread = threading.Thread(target=concurrent_reader)
            thread.start()
            thread.join(WAIT_S)
            probes.append((where, lock_free, not thread.is_alive(), served[0] if served else b""))

        class ProbedCopy(torch.Tensor):
            @classmethod
            def __torch_function__(
                cls,
                func: Any,
                types: Any,
                args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None,
            ) -> Any:
                if getattr(func, "__name__", "") == "copy_":
                    probe("insert copy")
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))

        big = payload((4096, 1024), torch.float32, seed=101)  # 16 MiB
        store.probe = probe
        with cache.request("encoder") as request:
            assert request.insert(["big"], [big.as_subclass(ProbedCopy)], publish=True) == [True]
            assert store.put_done.wait(WAIT_S)
            wait_until(lambda: cache.stats().publishes_ok == 1, "the publish")
        loaded = payload((1024, 1024), torch.float32, seed=102)
        store.put_object("loaded", raw(loaded))
        assert read_back(cache, item_of("loaded", loaded), "loader") == raw(loaded)

        assert [p[0] for p in probes] == ["insert copy", "put_from", "get_into"]
        for where, lock_free, reader_finished, served in probes:
            assert lock_free, f"cache lock held during {where}"
            assert reader_finished, f"a concurrent lookup blocked during {where}"
            assert served == raw(resident), where
        assert read_back(cache, item_of("big", big), "read-big") == raw(big)
        assert store.object("big") == raw(big)
        assert_clean(cache, [resident_item, item_of("big", big), item_of("loaded", loaded)])
    finally:
        store.release_holds()
        cache.close()
        store.close()
