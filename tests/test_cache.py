"""Unit tests of the cache controller (``EmbeddingCache`` and ``Request``), step by step.

Every test asserts the statuses, the bytes served, the entry states and the counters after
each step, and ends with ``check_invariants()`` and no pins left. The failures of the design
this one replaces have their own tests in ``test_cache_failures.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from embcache import EmbeddingCache, Item, ItemStatus, Reason, Request, Status
from embcache.core.lifecycle import ABSENT, LOADING, QUARANTINED, READY
from embcache.errors import (
    ClosedError,
    EmbCacheError,
    InvalidArgumentError,
    InvalidTypeError,
    RequestError,
)
from embcache.testing import NOT_FOUND, TIMED_OUT, Fault, FaultInjectingStore
from tests.support.helpers import aligned, item_of, payload, raw, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("poison_modes")]

ALIGN = 256
UNIT = 1024  # one slot: 256 float32
WAIT_S = 10.0
ACTIONS = {
    "Init",
    "OpenRequest",
    "CloseRequest",
    "Lookup",
    "BeginLoad",
    "EndLoad",
    "Release",
    "Evict",
    "Remove",
    "Publish",
    "EndPublish",
    "BeginFence",
    "Fence",
}


# ---------------------------------------------------------------------------- helpers
def slot(seed: int, units: int = 1) -> torch.Tensor:
    """A float32 tensor of ``units`` slots with seed-dependent values."""
    return payload((units * UNIT // 4,), torch.float32, seed)


def slot_item(key: str, units: int = 1) -> Item:
    return Item(key, (units * UNIT // 4,), torch.float32)


def assert_clean(cache: EmbeddingCache) -> None:
    """Invariants hold; no pins, requests or loads are left; accounting is exact."""
    cache.check_invariants()
    stats = cache.stats()
    assert stats.pinned_entries == 0 and stats.pinned_bytes == 0, stats
    assert stats.open_requests == 0, stats
    assert stats.entries_by_state.get("LOADING", 0) == 0, stats
    assert stats.allocated_bytes == sum(stats.bytes_by_state.values()), stats
    assert stats.allocated_bytes + stats.free_bytes == stats.capacity_bytes, stats


def insert(cache: EmbeddingCache, key: str, tensor: torch.Tensor, request_id: str = "") -> None:
    with cache.request(request_id or f"insert-{key}") as request:
        assert request.insert([key], [tensor], publish=False) == [True]


def read(cache: EmbeddingCache, item: Item, request_id: str = "") -> bytes | None:
    """The bytes a fresh request is served for ``item`` (loading if needed), None on fallback."""
    with cache.request(request_id or f"read-{item.key}") as request:
        request.lookup([item])
        assert request.wait(timeout=WAIT_S)
        view = request.embeddings()[0]
        if view is None:
            return None
        assert view.dtype == item.dtype and tuple(view.shape) == item.shape
        return raw(view)


def present(cache: EmbeddingCache, keys: Sequence[str]) -> set[str]:
    return {k for k in keys if cache.entry_state(k) is not ABSENT}


# ---------------------------------------------------------------------------- statuses
def test_hit_pins_a_zero_copy_view_until_the_request_ends(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache()
    data = payload((8, 40), torch.float16, seed=1)
    item = item_of("img", data)
    insert(cache, "img", data)
    with cache.request("r") as request:
        assert request.lookup([item]) == [ItemStatus(Status.HIT)]
        assert request.lookup([item]) == [ItemStatus(Status.HIT)]  # again: still one pin
        view = request.embeddings()[0]
        assert view is not None and raw(view) == raw(data)
        pool = cache.pool
        start = pool.data_ptr()
        assert start <= view.data_ptr() < start + cache.capacity  # a view into the pool
        assert view.data_ptr() + item.nbytes <= start + cache.capacity
        assert request.fallback_mask().tolist() == [0, 0]
        assert request.fallback_mask().dtype == torch.int32
        assert request.fallback_reasons() == [None, None]
        stats = cache.stats()
        assert stats.pinned_entries == 1 and stats.pinned_bytes == aligned(item.nbytes)
        assert stats.hits == 2
    assert_clean(cache)


def test_each_request_gets_its_own_view_objects(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    """Views share the pool's bytes but not their metadata: an in-place reshape stays local."""
    cache = make_cache()
    insert(cache, "a", slot(1))
    with cache.request("r1") as first, cache.request("r2") as second:
        first.lookup([slot_item("a")])
        second.lookup([slot_item("a")])
        (mine,), (theirs,) = first.embeddings(), second.embeddings()
        assert mine is not None and theirs is not None and mine is not theirs
        assert mine.data_ptr() == theirs.data_ptr()
        mine.unsqueeze_(0)
        assert theirs.shape == slot_item("a").shape
        (again,) = second.embeddings()
        assert again is not None and again.shape == slot_item("a").shape
        assert raw(again) == raw(slot(1))
    assert_clean(cache)


def test_closing_a_request_from_another_thread_ends_its_wait(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """A server cancelling a request (close on another thread) wakes the thread waiting on it."""
    cache = make_cache()
    store.put_object("img", raw(slot(1)))
    store.inject("img", Fault.HOLD)
    request = cache.request("r")
    assert request.lookup([slot_item("img")])[0].status is Status.LOADING
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(request.wait(timeout=WAIT_S)))
    waiter.start()
    time.sleep(0.05)  # let it block (if it has not yet, its wait returns at once: same result)
    started = time.monotonic()
    request.close()
    waiter.join(WAIT_S)
    assert woke == [True] and time.monotonic() - started < WAIT_S / 2, "the wait was not ended"
    store.release_holds()
    cache.close()
    assert_clean(cache)


def test_loading_from_the_store_then_ready(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    data = payload((16, 16), torch.float32, seed=2)
    item = item_of("img", data)
    store.put_object("img", raw(data))
    store.inject("img", Fault.HOLD)
    with cache.request("r") as request:
        assert request.lookup([item])[0].status is Status.LOADING
        assert cache.entry_state("img") is LOADING
        assert request.embeddings() == [None]
        assert not request.wait(timeout=0.02)
        assert request.fallback_mask().tolist() == [1]
        assert request.fallback_reasons() == [Reason.TIMEOUT]  # still loading
        store.release_holds()
        assert request.wait(timeout=WAIT_S)
        assert cache.entry_state("img") is READY
        view = request.embeddings()[0]
        assert view is not None and raw(view) == raw(data)
        assert request.fallback_mask().tolist() == [0]
        assert request.fallback_reasons() == [None]
    stats = cache.stats()
    assert (stats.loads_started, stats.loads_ok) == (1, 1)
    assert_clean(cache)


def test_entry_states_reads_each_keys_state_and_item_of_matrix_is_a_2d_item(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    data = payload((16, 16), torch.float32, seed=3)
    assert Item.of_matrix("img", 16, 16, torch.float32) == item_of("img", data)
    assert Item.of_matrix("img", 16, 16, torch.float32).nbytes == data.nbytes
    keys, rows = ["a", "b", "a"], [3, 1, 5]
    batch = Item.of_matrices(keys, rows, 7, torch.bfloat16)
    one_by_one = [Item.of_matrix(k, n, 7, torch.bfloat16) for k, n in zip(keys, rows, strict=True)]
    assert batch == one_by_one
    assert [i.nbytes for i in batch] == [42, 14, 70]
    assert Item.of_matrices([], [], 1, torch.float32) == []
    store.put_object("img", raw(data))
    store.inject("img", Fault.HOLD)
    with cache.request("r") as request:
        found = request.lookup([Item.of_matrix("img", 16, 16, torch.float32)])
        assert found == [ItemStatus(Status.LOADING)]
        assert cache.entry_states(["img", "nope", "img"]) == [LOADING, ABSENT, LOADING]
        store.release_holds()
        assert request.wait(timeout=WAIT_S)
    assert cache.entry_states(["nope", "img"]) == [ABSENT, READY]
    assert cache.entry_states([]) == []
    assert_clean(cache)


def test_reserved_then_insert_fills_it(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache()
    data = payload((4, 64), torch.bfloat16, seed=3)
    item = item_of("img", data)
    with cache.request("r") as request:
        assert request.lookup([item], reserve_misses=True)[0].status is Status.RESERVED
        assert cache.entry_state("img") is LOADING
        assert request.wait(timeout=0)  # never waits on its own reservation
        assert request.fallback_mask().tolist() == [1]
        assert request.insert(["img"], [data], publish=False) == [True]
        assert cache.entry_state("img") is READY
        view = request.embeddings()[0]
        assert view is not None and raw(view) == raw(data)
        assert request.fallback_mask().tolist() == [0]
    assert read(cache, item) == raw(data)
    assert_clean(cache)


def test_miss_not_found(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    item = slot_item("img")
    with cache.request("r") as request:
        for prefetch in (True, False, True):
            assert request.lookup([item], prefetch=prefetch) == [
                ItemStatus(Status.MISS, Reason.NOT_FOUND)
            ]
        assert request.fallback_reasons() == [Reason.NOT_FOUND] * 3
        assert request.embeddings() == [None] * 3
    assert cache.entry_state("img") is ABSENT
    store.put_object("img", raw(slot(3)))
    calls = store.calls["exists"]
    with cache.request("no-prefetch") as request:  # prefetch=False never asks the store
        assert request.lookup([item], prefetch=False)[0].reason is Reason.NOT_FOUND
    assert store.calls["exists"] == calls
    assert cache.stats().misses_by_reason == {"not_found": 4}
    assert_clean(cache)


def test_miss_too_large(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache(capacity=4 * UNIT)
    big = slot_item("big", units=5)
    store.put_object("big", raw(slot(4, units=5)))
    with cache.request("r") as request:
        for kwargs in ({}, {"reserve_misses": True}, {"prefetch": False}):
            statuses = request.lookup([big], **kwargs)
            assert statuses[0].status is Status.MISS
            assert statuses[0].reason is Reason.TOO_LARGE
        assert request.insert(["big"], [slot(4, units=5)], publish=False) == [False]
    assert cache.entry_state("big") is ABSENT
    assert cache.stats().misses_by_reason == {"too_large": 3}
    assert cache.stats().allocated_bytes == 0
    assert_clean(cache)


def test_miss_no_space_when_everything_is_pinned(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache(capacity=2 * UNIT)
    insert(cache, "a", slot(1))
    insert(cache, "b", slot(2))
    store.put_object("c", raw(slot(3)))
    with cache.request("pins") as pins:
        pins.lookup([slot_item("a"), slot_item("b")])
        with cache.request("r") as request:
            for kwargs in ({}, {"reserve_misses": True}):  # a store load or a reservation
                statuses = request.lookup([slot_item("c")], **kwargs)
                assert statuses[0].status is Status.MISS
                assert statuses[0].reason is Reason.NO_SPACE
            assert request.fallback_reasons() == [Reason.NO_SPACE] * 2
        stats = cache.stats()
        assert stats.evictions == 0
        assert stats.allocation_failures_by_reason == {"no_space": 2}
        assert stats.misses_by_reason == {"no_space": 2}
    assert read(cache, slot_item("c")) == raw(slot(3))  # unpinned: now it fits by eviction
    assert_clean(cache)


def test_miss_mismatch(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache()
    data = payload((8, 8), torch.float32, seed=5)
    insert(cache, "img", data)
    with cache.request("r") as request:
        for other in (Item("img", (4, 16), torch.float32), Item("img", (8, 8), torch.float16)):
            statuses = request.lookup([other], reserve_misses=True)
            assert statuses[0].status is Status.MISS
            assert statuses[0].reason is Reason.MISMATCH
        assert request.embeddings() == [None, None]
        assert request.insert(["img"], [torch.zeros(4, 16)], publish=False) == [False]
    assert read(cache, item_of("img", data)) == raw(data)  # left alone
    assert cache.stats().misses_by_reason == {"mismatch": 2}
    assert_clean(cache)


def test_miss_busy_for_doomed_and_quarantined_entries(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    insert(cache, "doomed", slot(1))
    store.put_object("quarantined", raw(slot(2)))
    store.inject("quarantined", Fault.UNKNOWN)
    assert read(cache, slot_item("quarantined")) is None
    assert cache.entry_state("quarantined") is QUARANTINED
    with cache.request("holder") as holder:
        holder.lookup([slot_item("doomed")])
        assert cache.remove("doomed")
        with cache.request("r") as request:
            for key in ("doomed", "quarantined"):
                for kwargs in ({}, {"reserve_misses": True}):
                    statuses = request.lookup([slot_item(key)], **kwargs)
                    assert statuses[0].status is Status.MISS
                    assert statuses[0].reason is Reason.BUSY
        assert cache.entry_state("doomed") is READY
    assert cache.entry_state("doomed") is ABSENT
    assert cache.stats().misses_by_reason == {"busy": 4}
    assert cache.fence() == 1
    assert_clean(cache)


class ExistsRaises(FaultInjectingStore):
    def exists(self, keys: Sequence[str]) -> list[bool]:
        raise ConnectionError("the store's master is down")


def test_miss_store_error_when_exists_raises(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache(store=ExistsRaises())
    insert(cache, "hit", slot(1))
    with cache.request("r") as request:
        statuses = request.lookup([slot_item("hit"), slot_item("absent")])
        assert statuses[0].status is Status.HIT
        assert statuses[1].status is Status.MISS
        assert statuses[1].reason is Reason.STORE_ERROR
        assert request.fallback_mask().tolist() == [0, 1]
        assert request.lookup([slot_item("absent")], prefetch=False)[0].reason is Reason.NOT_FOUND
        reserved = request.lookup([slot_item("absent")], reserve_misses=True)
        assert reserved[0].status is Status.RESERVED  # the caller encodes it either way
    assert cache.stats().misses_by_reason == {"store_error": 1, "not_found": 1}
    assert_clean(cache)


def test_insert_of_a_present_key_not_reserved_is_left_alone(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache()
    insert(cache, "ready", slot(1))
    with cache.request("owner") as owner, cache.request("other") as other:
        reserved = owner.lookup([slot_item("loading")], reserve_misses=True)
        assert reserved == [ItemStatus(Status.RESERVED)]
        assert other.insert(["ready", "loading"], [slot(9), slot(9)], publish=False) == [
            False,
            False,
        ]
        assert cache.entry_state("loading") is LOADING  # still owner's reservation
        assert owner.insert(["loading"], [slot(2)], publish=False) == [True]
        assert cache.stats().pinned_entries == 1  # other holds nothing
    assert read(cache, slot_item("ready")) == raw(slot(1))
    assert read(cache, slot_item("loading")) == raw(slot(2))
    assert_clean(cache)


def test_insert_pins_for_the_request_and_lookup_then_serves_it(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache(capacity=UNIT)
    with cache.request("r") as request:
        assert request.insert(["a"], [slot(1)], publish=False) == [True]
        assert cache.stats().pinned_entries == 1
        with cache.request("other") as other:  # pinned: not evictable for another key
            assert other.lookup([slot_item("b")], reserve_misses=True)[0].reason is (
                Reason.NO_SPACE
            )
        assert request.lookup([slot_item("a")])[0].status is Status.HIT
        view = request.embeddings()[0]
        assert view is not None and raw(view) == raw(slot(1))
        assert cache.stats().pinned_entries == 1
    assert_clean(cache)


def test_duplicate_insert_key_is_inserted_once(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache()
    with cache.request("r") as request:
        results = request.insert(["a", "a"], [slot(1), slot(2)], publish=False)
        assert results[0] is True
        assert cache.stats().inserts == 1
    assert read(cache, slot_item("a")) == raw(slot(1))
    assert cache.stats().allocated_bytes == UNIT
    assert_clean(cache)


# ---------------------------------------------------------------------------- single flight
def test_single_flight_waiter_holds_the_insert(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache()
    data = payload((32, 8), torch.float32, seed=7)
    item = item_of("img", data)
    a = cache.request("a")
    with cache.request("b") as b:
        assert a.lookup([item], reserve_misses=True)[0].status is Status.RESERVED
        assert b.lookup([item], reserve_misses=True)[0].status is Status.LOADING  # joins
        assert cache.stats().single_flight_joins == 1
        assert not b.wait(timeout=0.02)
        assert b.embeddings() == [None]
        assert a.insert(["img"], [data], publish=False) == [True]
        assert b.wait(timeout=WAIT_S)
        a.close()
        assert cache.stats().pinned_entries == 1  # b's own pin, from EndLoad
        view = b.embeddings()[0]
        assert view is not None and raw(view) == raw(data)
        assert b.fallback_mask().tolist() == [0]
    assert_clean(cache)


def test_single_flight_abandoned_reservation_falls_back(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache()
    item = slot_item("img")
    with cache.request("b") as b:
        with cache.request("a") as a:
            assert a.lookup([item], reserve_misses=True)[0].status is Status.RESERVED
            assert b.lookup([item])[0].status is Status.LOADING
        assert b.wait(timeout=WAIT_S)  # a left without inserting
        assert b.fallback_mask().tolist() == [1]
        assert b.fallback_reasons() == [Reason.ABANDONED]
        assert b.embeddings() == [None]
        assert cache.entry_state("img") is ABSENT
        assert cache.stats().allocated_bytes == 0
        again = b.lookup([item], reserve_misses=True)  # b may now take it over
        assert again[0].status is Status.RESERVED
        assert b.insert(["img"], [slot(8)], publish=False) == [True]
    assert cache.stats().fallbacks_by_reason == {"abandoned": 2}  # a's reservation and b's wait
    assert read(cache, item) == raw(slot(8))
    assert_clean(cache)


def test_reservation_ended_by_an_exception_wakes_waiters(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache()
    item = slot_item("img")
    with cache.request("b") as b:
        with pytest.raises(KeyError), cache.request("a") as a:
            a.lookup([item], reserve_misses=True)
            b.lookup([item])
            raise KeyError("the encoder failed")
        assert b.wait(timeout=WAIT_S)
        assert b.fallback_reasons() == [Reason.ABANDONED]
    assert cache.entry_state("img") is ABSENT
    assert_clean(cache)


# ---------------------------------------------------------------------------- duplicates
def test_duplicate_key_in_one_lookup_has_the_first_status_and_one_pin(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    trace: list[dict[str, Any]] = []
    cache = make_cache(trace=trace)
    insert(cache, "hit", slot(1))
    store.put_object("load", raw(slot(2)))
    with cache.request("r") as request:
        statuses = request.lookup(
            [slot_item(k) for k in ("hit", "hit", "load", "load", "new", "new")]
            + [slot_item("huge", units=2000)] * 2,
            reserve_misses=True,
        )
        assert [s.status for s in statuses[:6]] == [
            Status.HIT,
            Status.HIT,
            Status.LOADING,
            Status.LOADING,
            Status.RESERVED,
            Status.RESERVED,
        ]
        assert statuses[6] == statuses[7] == ItemStatus(Status.MISS, Reason.TOO_LARGE)
        assert request.wait(timeout=WAIT_S)
        assert store.calls["get_into"] == 1
        assert cache.stats().pinned_entries == 2  # hit and load, once each
        holders = [e for e in trace if e["key"] == "hit" and e["action"] == "Lookup"]
        assert holders[-1]["holders"] == ["r"]
        views = request.embeddings()
        assert raw(views[0]) == raw(views[1]) == raw(slot(1))  # type: ignore[arg-type]
        assert raw(views[2]) == raw(views[3]) == raw(slot(2))  # type: ignore[arg-type]
        assert request.fallback_mask().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        assert request.insert(["new"], [slot(3)], publish=False) == [True]
        assert request.fallback_mask().tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    releases = [e["key"] for e in trace if e["action"] == "Release" and e["request"] == "r"]
    assert releases == ["hit", "load", "new"]  # one per pin
    assert_clean(cache)


# ---------------------------------------------------------------------------- remove
def test_remove_idle_entry_frees_it(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache()
    insert(cache, "a", slot(1))
    assert cache.remove("a") is True
    assert cache.entry_state("a") is ABSENT
    assert cache.stats().allocated_bytes == 0
    assert cache.remove("a") is False  # absent
    assert cache.remove("never") is False
    assert_clean(cache)


def test_remove_busy_entry_dooms_it_until_the_last_release(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache()
    insert(cache, "a", slot(1))
    first, second = cache.request("first"), cache.request("second")
    first.lookup([slot_item("a")])
    second.lookup([slot_item("a")])
    assert cache.remove("a") is True
    assert cache.remove("a") is False  # already doomed
    assert cache.entry_state("a") is READY
    with cache.request("late") as late:
        assert late.lookup([slot_item("a")])[0].reason is Reason.BUSY
    first.close()
    assert cache.entry_state("a") is READY
    view = second.embeddings()[0]
    assert view is not None and raw(view) == raw(slot(1))
    assert cache.stats().allocated_bytes == UNIT
    second.close()
    assert cache.entry_state("a") is ABSENT  # freed on the last release, never evicted
    stats = cache.stats()
    assert stats.allocated_bytes == 0 and stats.evictions == 0
    insert(cache, "a", slot(2))
    assert read(cache, slot_item("a")) == raw(slot(2))
    assert_clean(cache)


def test_remove_loading_entry_fails_its_waiters_when_the_load_ends(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    store.put_object("a", raw(slot(1)))
    store.inject("a", Fault.HOLD)
    with cache.request("r") as request:
        request.lookup([slot_item("a")])
        assert cache.remove("a") is True
        assert cache.entry_state("a") is LOADING  # the read still targets its range
        assert cache.stats().allocated_bytes == UNIT
        store.release_holds()
        assert request.wait(timeout=WAIT_S)
        assert request.fallback_reasons() == [Reason.REMOVED]
        assert request.embeddings() == [None]
    assert cache.entry_state("a") is ABSENT
    assert cache.stats().allocated_bytes == 0
    assert_clean(cache)


def test_remove_reserved_entry_then_insert_is_not_cached(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache()
    with cache.request("r") as request:
        request.lookup([slot_item("a")], reserve_misses=True)
        assert cache.remove("a") is True
        assert request.insert(["a"], [slot(1)], publish=False) == [False]
        assert request.fallback_reasons() == [Reason.REMOVED]
    assert cache.entry_state("a") is ABSENT
    assert cache.stats().allocated_bytes == 0
    assert_clean(cache)


def test_remove_quarantined_entry_waits_for_fence(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    store.put_object("a", raw(slot(1)))
    store.inject("a", Fault.UNKNOWN)
    assert read(cache, slot_item("a")) is None
    assert cache.remove("a") is False
    assert cache.entry_state("a") is QUARANTINED
    assert cache.stats().allocated_bytes == UNIT
    assert cache.fence() == 1
    assert cache.entry_state("a") is ABSENT
    assert_clean(cache)


# ---------------------------------------------------------------------------- quarantine
def test_unknown_load_is_quarantined_and_freed_only_by_fence(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache(capacity=2 * UNIT, policy="lru")
    store.put_object("q", raw(slot(1)))
    store.inject("q", Fault.UNKNOWN)
    with cache.request("r") as request:
        assert request.lookup([slot_item("q")])[0].status is Status.LOADING
        assert request.wait(timeout=WAIT_S)
        assert request.fallback_reasons() == [Reason.LOAD_UNKNOWN]
    assert cache.entry_state("q") is QUARANTINED
    assert cache.clear() == 0
    insert(cache, "other", slot(2))
    with cache.request("pressure") as request:  # its range is neither evicted nor reused
        statuses = request.lookup([slot_item("big", units=2)], reserve_misses=True)
        assert statuses == [ItemStatus(Status.MISS, Reason.NO_SPACE)]
        assert cache.entry_state("other") is READY  # nothing evicted for nothing
        assert request.insert(["big2"], [slot(3)], publish=False) == [True]  # evicts "other"
    assert cache.entry_state("q") is QUARANTINED
    assert cache.entry_state("other") is ABSENT
    stats = cache.stats()
    assert stats.entries_by_state == {"QUARANTINED": 1, "READY": 1}
    assert stats.bytes_by_state == {"QUARANTINED": UNIT, "READY": UNIT}
    assert stats.loads_unknown == 1
    fences = store.calls["fence"]
    assert cache.fence() == 1
    assert store.calls["fence"] == fences + 1
    assert cache.entry_state("q") is ABSENT
    assert cache.fence() == 0
    store.inject("q", None)
    assert read(cache, slot_item("q")) == raw(slot(1))
    assert cache.stats().fences == 2
    assert_clean(cache)


class GatedPutStore(FaultInjectingStore):
    """``put_from`` blocks until ``gate`` opens, then answers ``code`` for every key."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.code = code

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        assert self.gate.wait(WAIT_S)
        return [self.code] * len(keys)


def test_unknown_publish_quarantines_once_the_last_pin_goes(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    store = GatedPutStore(TIMED_OUT)
    cache = make_cache(store=store)
    with cache.request("r") as request:  # the publish ends while the request still holds it
        assert request.insert(["held"], [slot(1)], publish=True) == [True]
        store.gate.set()
        wait_until(lambda: cache.stats().publishes_unknown == 1, "the publish")
        assert cache.entry_state("held") is READY
        assert cache.stats().pinned_entries == 1
    assert cache.entry_state("held") is QUARANTINED

    store.gate.clear()
    with cache.request("s") as request:  # the request ends first; the publish pin stays
        assert request.insert(["late"], [slot(2)], publish=True) == [True]
    assert cache.entry_state("late") is READY
    assert cache.stats().pinned_entries == 1
    assert cache.remove("late") is True  # doomed, but quarantine wins when the pin goes
    store.gate.set()
    wait_until(lambda: cache.stats().publishes_unknown == 2, "the second publish")
    assert cache.entry_state("late") is QUARANTINED
    assert cache.stats().pinned_entries == 0
    assert cache.fence() == 2
    assert cache.stats().allocated_bytes == 0
    assert_clean(cache)


def test_publish_runs_under_its_own_pin(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache(capacity=UNIT, policy="lru")
    store.inject("a", Fault.HOLD)
    with cache.request("r") as request:
        assert request.insert(["a"], [slot(1)], publish=True) == [True]
    stats = cache.stats()
    assert stats.publishes_started == 1 and stats.pinned_entries == 1
    with cache.request("pressure") as request:  # not evictable while it is being published
        assert request.lookup([slot_item("b")], reserve_misses=True)[0].reason is Reason.NO_SPACE
    store.release_holds()
    wait_until(lambda: cache.stats().publishes_ok == 1, "the publish")
    assert store.object("a") == raw(slot(1))
    assert cache.stats().pinned_entries == 0
    insert(cache, "b", slot(2))  # now it is evictable
    assert cache.entry_state("a") is ABSENT
    assert_clean(cache)


def test_failed_publish_keeps_the_entry(make_cache: Callable[..., EmbeddingCache]) -> None:
    store = GatedPutStore(NOT_FOUND)
    store.gate.set()
    cache = make_cache(store=store)
    with cache.request("r") as request:
        assert request.insert(["a"], [slot(1)], publish=True) == [True]
        wait_until(lambda: cache.stats().publishes_failed == 1, "the publish")
    assert cache.entry_state("a") is READY
    assert read(cache, slot_item("a")) == raw(slot(1))
    assert_clean(cache)


# ---------------------------------------------------------------------------- clear, close
def test_clear_frees_idle_and_dooms_busy_entries(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    insert(cache, "idle", slot(1))
    insert(cache, "busy", slot(2))
    store.put_object("loading", raw(slot(3)))
    store.put_object("quarantined", raw(slot(4)))
    store.inject("quarantined", Fault.UNKNOWN)
    assert read(cache, slot_item("quarantined")) is None
    store.inject("loading", Fault.HOLD)
    with cache.request("r") as request:
        request.lookup([slot_item("busy"), slot_item("loading")])
        assert cache.clear() == 3
        assert cache.entry_state("idle") is ABSENT
        assert cache.entry_state("busy") is READY
        assert cache.entry_state("loading") is LOADING
        assert cache.entry_state("quarantined") is QUARANTINED
        store.release_holds()
        assert request.wait(timeout=WAIT_S)
        assert request.fallback_reasons() == [None, Reason.REMOVED]
        view = request.embeddings()[0]
        assert view is not None and raw(view) == raw(slot(2))
    assert present(cache, ["idle", "busy", "loading", "quarantined"]) == {"quarantined"}
    assert cache.clear() == 0
    assert cache.fence() == 1
    assert cache.stats().allocated_bytes == 0
    assert_clean(cache)


def test_close_then_use_raises_closed_error(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    insert(cache, "a", slot(1))
    store.put_object("slow", raw(slot(2)))
    store.inject("slow", Fault.DELAY)
    request = cache.request("open")
    assert request.lookup([slot_item("slow")])[0].status is Status.LOADING
    cache.close()  # finishes the transfer in flight
    assert cache.stats().loads_ok == 1
    cache.close()  # idempotent
    with pytest.raises(ClosedError, match="closed"):
        cache.request("new")
    with pytest.raises(ClosedError, match="closed"):
        request.lookup([slot_item("a")])
    with pytest.raises(ClosedError, match="closed"):
        request.insert(["b"], [slot(3)])
    with pytest.raises(ClosedError, match="closed"):
        request.embeddings()
    with pytest.raises(ClosedError, match="closed"):
        request.fallback_mask()
    with pytest.raises(ClosedError, match="closed"):
        cache.fence()
    request.close()  # leaving a request still works and releases its pin
    assert_clean(cache)


# ---------------------------------------------------------------------------- waiting
def test_wait_async_does_not_block_the_event_loop(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    store.put_object("a", raw(slot(1)))
    store.inject("a", Fault.HOLD)

    async def scenario(request: Request) -> bool:
        assert await request.wait_async(timeout=0.02) is False  # held
        task = asyncio.create_task(request.wait_async(timeout=WAIT_S))
        await asyncio.sleep(0)  # the task is now parked on its future, the loop runs on
        assert not task.done()
        store.release_holds()
        return await task

    with cache.request("r") as request:
        request.lookup([slot_item("a")])
        assert asyncio.run(scenario(request)) is True
        view = request.embeddings()[0]
        assert view is not None and raw(view) == raw(slot(1))
        assert asyncio.run(request.wait_async()) is True  # nothing pending: at once
    assert_clean(cache)


def test_timed_out_async_wait_on_a_finished_loop_does_not_block_other_waiters(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """A wait_async that timed out under ``asyncio.run`` leaves a future on a closed loop; the
    load's completion must still wake every other request waiting on it."""
    cache = make_cache()
    store.put_object("a", raw(slot(1)))
    store.inject("a", Fault.HOLD)
    with cache.request("async") as first, cache.request("sync") as second:
        first.lookup([slot_item("a")])
        second.lookup([slot_item("a")])
        assert asyncio.run(first.wait_async(timeout=0.01)) is False
        store.release_holds()
        assert second.wait(timeout=5.0)
        assert first.wait(timeout=5.0)
        view = second.embeddings()[0]
        assert view is not None and raw(view) == raw(slot(1))
    assert_clean(cache)


class GatedDone(threading.Event):
    """A request's completion event whose first ``set`` from an I/O thread waits for a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.finished = threading.Event()

    def set(self) -> None:
        io_thread = threading.current_thread().name.startswith("embcache-io")
        if io_thread and not self.gate.is_set():
            self.entered.set()
            self.gate.wait(WAIT_S)
        super().set()
        if io_thread:
            self.finished.set()


def test_wait_is_not_ended_by_a_stale_wake_up(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """The wake-up for load A, delivered late, must not end a wait on load B started meanwhile.

    The schedule is forced by delaying the I/O thread's ``set`` of the request's completion
    event (made by the cache's ``new_event``; the interleaving itself is an ordinary one). The
    lookup of B runs on a helper thread: if the wake-up is delivered under the cache lock, that
    lookup cannot overtake it, and the gate opens after a bounded wait instead.
    """
    done = GatedDone()
    cache = make_cache(new_event=lambda: done)
    store.put_object("a", raw(slot(1)))
    store.put_object("b", raw(slot(2)))
    store.inject("b", Fault.HOLD)
    with cache.request("r") as request:
        request.lookup([slot_item("a")])
        assert done.entered.wait(WAIT_S)  # load A ended; its wake-up is on its way
        statuses: list[ItemStatus] = []
        looker = threading.Thread(target=lambda: statuses.extend(request.lookup([slot_item("b")])))
        looker.start()
        looker.join(0.5)  # returns at once unless the lookup waits behind the wake-up
        done.gate.set()
        looker.join(WAIT_S)
        assert not looker.is_alive()
        assert statuses == [ItemStatus(Status.LOADING)]
        assert done.finished.wait(WAIT_S)
        assert cache.entry_state("b") is LOADING
        woke = request.wait(timeout=0.05)
        reasons = request.fallback_reasons()
        store.release_holds()
        assert request.wait(timeout=WAIT_S)
        assert not woke, f"wait() returned True while b was still loading ({reasons})"
    assert_clean(cache)


# ---------------------------------------------------------------------------- eviction
def test_eviction_order_is_lru_with_uniform_sizes(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    trace: list[dict[str, Any]] = []
    cache = make_cache(capacity=4 * UNIT, trace=trace, policy="lru")
    for i, key in enumerate("abcd"):
        insert(cache, key, slot(i))
    assert read(cache, slot_item("a")) == raw(slot(0))  # a is now the most recent

    def evicted() -> list[str]:
        return [e["key"] for e in trace if e["action"] == "Evict"]

    insert(cache, "e", slot(10))
    assert evicted() == ["b"]
    insert(cache, "f", slot(11))
    assert evicted() == ["b", "c"]
    assert read(cache, slot_item("d")) == raw(slot(3))
    insert(cache, "g", slot(12))
    assert evicted() == ["b", "c", "a"]
    assert present(cache, list("abcdefg")) == {"d", "e", "f", "g"}
    stats = cache.stats()
    assert stats.evictions == 3 and stats.evicted_bytes == 3 * UNIT
    assert_clean(cache)


def test_eviction_matches_an_lru_model_with_uniform_sizes(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    """Seeded random hits and inserts over 16 keys in an 8-slot pool: victims are plain LRU."""
    trace: list[dict[str, Any]] = []
    cache = make_cache(capacity=8 * UNIT, trace=trace, policy="lru")
    model: OrderedDict[str, None] = OrderedDict()
    rng = random.Random(1234)
    keys = [f"k{i}" for i in range(16)]
    for step in range(300):
        key = rng.choice(keys)
        if rng.random() < 0.05:
            assert cache.remove(key) is (key in model)
            model.pop(key, None)
            continue
        seen = len(trace)
        with cache.request(f"s{step}") as request:
            status = request.lookup([slot_item(key)], prefetch=False, reserve_misses=True)[0]
            if key in model:
                assert status.status is Status.HIT
            else:
                assert status.status is Status.RESERVED
                assert request.insert([key], [slot(int(key[1:]))], publish=False) == [True]
                if len(model) == 8:
                    expected = next(iter(model))
                    victims = [e["key"] for e in trace[seen:] if e["action"] == "Evict"]
                    assert victims == [expected], step
                    del model[expected]
            view = request.embeddings()[0]
            assert view is not None and raw(view) == raw(slot(int(key[1:])))
        model[key] = None
        model.move_to_end(key)
        assert present(cache, keys) == set(model), step
    assert_clean(cache)


def test_eviction_disabled_never_evicts(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache(capacity=2 * UNIT, enable_eviction=False)
    insert(cache, "a", slot(1))
    insert(cache, "b", slot(2))
    with cache.request("r") as request:
        assert request.lookup([slot_item("c")], reserve_misses=True)[0].reason is Reason.NO_SPACE
        assert request.insert(["c"], [slot(3)], publish=False) == [False]
    assert cache.stats().evictions == 0
    assert present(cache, ["a", "b", "c"]) == {"a", "b"}
    assert cache.remove("a")
    insert(cache, "c", slot(3))
    assert read(cache, slot_item("c")) == raw(slot(3))
    assert_clean(cache)


def test_eviction_batch_limit_evicts_nothing_when_exceeded(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache(capacity=4 * UNIT, max_eviction_batch=2, policy="lru")
    for i, key in enumerate("abcd"):
        insert(cache, key, slot(i))
    with cache.request("r") as request:
        statuses = request.lookup([slot_item("big", units=3)], reserve_misses=True)
        assert statuses[0].reason is Reason.NO_SPACE
    assert cache.stats().evictions == 0
    assert present(cache, list("abcd")) == set("abcd")
    with cache.request("r") as request:
        statuses = request.lookup([slot_item("two", units=2)], reserve_misses=True)
        assert statuses[0].status is Status.RESERVED
        assert request.insert(["two"], [slot(9, units=2)], publish=False) == [True]
    assert present(cache, list("abcd")) == {"c", "d"}
    assert_clean(cache)


# ---------------------------------------------------------------------------- stats, trace
def test_stats_counters_and_occupancy(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache(capacity=4 * UNIT)
    fresh = cache.stats()
    assert fresh.capacity_bytes == 4 * UNIT and fresh.free_bytes == 4 * UNIT
    assert fresh.largest_free_block == 4 * UNIT and fresh.fragmentation == 0.0
    assert fresh.entries == 0 and fresh.hits == 0 and fresh.evictions == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        fresh.hits = 1  # type: ignore[misc]

    for i, key in enumerate("abcd"):
        insert(cache, key, slot(i))
    assert cache.remove("a") and cache.remove("c")
    stats = cache.stats()
    assert stats.free_bytes == 2 * UNIT and stats.largest_free_block == UNIT
    assert stats.fragmentation == pytest.approx(0.5)
    assert stats.entries_by_state == {"READY": 2} and stats.entries == 2
    assert stats.inserts == 4

    store.put_object("loaded", raw(slot(5)))
    store.put_object("failed", raw(slot(6)))
    store.inject("failed", Fault.FAIL)
    with cache.request("r") as request:
        request.lookup([slot_item("b"), slot_item("loaded"), slot_item("failed")])
        request.lookup([slot_item("b", units=2), slot_item("huge", units=5), slot_item("nope")])
        assert request.wait(timeout=WAIT_S)
        wait_until(lambda: cache.stats().oldest_pin_age_s > 0, "a pin to age")
        stats = cache.stats()
        assert stats.pinned_entries == 2 and stats.pinned_bytes == 2 * UNIT
        assert stats.open_requests == 1
    with cache.request("a") as a, cache.request("b") as b:
        a.lookup([slot_item("x")], reserve_misses=True)
        b.lookup([slot_item("x")], reserve_misses=True)
    stats = cache.stats()
    assert stats.hits == 1
    assert stats.misses_by_reason == {"mismatch": 1, "too_large": 1, "not_found": 1}
    assert stats.fallbacks_by_reason == {"load_failed": 1, "abandoned": 1}
    assert (stats.loads_started, stats.loads_ok, stats.loads_failed) == (2, 1, 1)
    assert stats.loads_unknown == 0
    assert stats.single_flight_joins == 1
    assert stats.pinned_entries == 0 and stats.oldest_pin_age_s == 0.0
    assert stats.open_requests == 0
    assert stats.evictions == 0 and stats.fences == 0
    assert stats.publishes_started == 0
    assert_clean(cache)


def test_trace_has_one_event_per_action_in_order(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    trace: list[dict[str, Any]] = []
    cache = make_cache(capacity=2 * UNIT, trace=trace, policy="lru")
    with cache.request("r1") as request:
        request.lookup([slot_item("A")], reserve_misses=True)
        request.insert(["A"], [slot(1)], publish=False)
    with cache.request("r2") as request:
        request.lookup([slot_item("A")])
        cache.remove("A")
    store.put_object("B", raw(slot(2)))
    with cache.request("r3") as request:
        request.lookup([slot_item("B")])
        assert request.wait(timeout=WAIT_S)
    with cache.request("r4") as request:
        request.insert(["C", "D"], [slot(3), slot(4)], publish=True)
        wait_until(lambda: cache.stats().publishes_ok == 2, "the publishes")
    store.put_object("E", raw(slot(5)))
    store.inject("E", Fault.UNKNOWN)
    with cache.request("r5") as request:
        request.lookup([slot_item("E")])
        assert request.wait(timeout=WAIT_S)
    cache.fence()

    assert [e["seq"] for e in trace] == list(range(1, len(trace) + 1))
    assert {e["action"] for e in trace} <= ACTIONS
    steps = [(e["action"], e["request"], e["key"], e["outcome"]) for e in trace]
    assert (trace[0]["capacity"], trace[0]["alignment"]) == (2 * UNIT, 256)
    assert steps == [
        ("Init", None, None, None),
        ("OpenRequest", "r1", None, None),
        ("Lookup", "r1", "A", "MISS"),
        ("BeginLoad", "r1", "A", "OK"),
        ("EndLoad", None, "A", "OK"),
        ("Release", "r1", "A", None),
        ("CloseRequest", "r1", None, None),
        ("OpenRequest", "r2", None, None),
        ("Lookup", "r2", "A", "HIT"),
        ("Remove", None, "A", None),
        ("Release", "r2", "A", None),
        ("CloseRequest", "r2", None, None),
        ("OpenRequest", "r3", None, None),
        ("Lookup", "r3", "B", "MISS"),
        ("BeginLoad", "r3", "B", "OK"),
        ("EndLoad", None, "B", "OK"),
        ("Release", "r3", "B", None),
        ("CloseRequest", "r3", None, None),
        ("OpenRequest", "r4", None, None),
        ("BeginLoad", "r4", "C", "OK"),
        ("Evict", None, "B", None),
        ("BeginLoad", "r4", "D", "OK"),
        ("EndLoad", None, "C", "OK"),
        ("EndLoad", None, "D", "OK"),
        ("Publish", "r4", "C", None),
        ("Publish", "r4", "D", None),
        ("EndPublish", "r4", "C", "OK"),
        ("EndPublish", "r4", "D", "OK"),
        ("Release", "r4", "C", None),
        ("Release", "r4", "D", None),
        ("CloseRequest", "r4", None, None),
        ("OpenRequest", "r5", None, None),
        ("Lookup", "r5", "E", "MISS"),
        ("Evict", None, "C", None),
        ("BeginLoad", "r5", "E", "OK"),
        ("EndLoad", None, "E", "UNKNOWN"),
        ("CloseRequest", "r5", None, None),
        ("BeginFence", None, None, None),
        ("Fence", None, None, None),
    ]
    by_seq = {e["seq"]: e for e in trace}
    assert (by_seq[4]["offset"], by_seq[4]["size"], by_seq[4]["state"]) == (0, UNIT, "LOADING")
    assert by_seq[11]["state"] == "ABSENT"  # the last release freed the removed entry
    assert by_seq[21]["offset"] == 0 and by_seq[22]["offset"] == 0  # D reuses B's range
    assert by_seq[36]["state"] == "QUARANTINED"
    assert (by_seq[38]["fence"], by_seq[38]["keys"]) == (1, ["E"])  # BeginFence: the snapshot
    assert (by_seq[39]["fence"], by_seq[39]["keys"]) == (1, ["E"])  # Fence: what it freed
    assert_clean(cache)


# ---------------------------------------------------------------------------- bad input
@dataclasses.dataclass
class Setup:
    """A cache with an idle, a held and a reserved entry, a closed request and a closed cache."""

    cache: EmbeddingCache
    trace: list[dict[str, Any]]
    holder: Request
    filler: Request
    closed_request: Request
    closed_cache: EmbeddingCache
    stale: Request  # opened on closed_cache before it was closed


def snapshot(setup: Setup) -> tuple[Any, ...]:
    def frozen(cache: EmbeddingCache) -> Any:
        return dataclasses.replace(cache.stats(), oldest_pin_age_s=0.0)

    keys = ["idle", "held", "reserved", "fresh", "k"]
    return (
        frozen(setup.cache),
        frozen(setup.closed_cache),
        [setup.cache.entry_state(k) for k in keys],
        len(setup.trace),
        setup.holder.fallback_mask().tolist(),
        setup.filler.fallback_mask().tolist(),
    )


@pytest.fixture
def setup(make_cache: Callable[..., EmbeddingCache]) -> Iterator[Setup]:
    trace: list[dict[str, Any]] = []
    cache = make_cache(trace=trace)
    insert(cache, "idle", slot(1))
    insert(cache, "held", slot(2))
    holder = cache.request("holder")
    holder.lookup([slot_item("held")])
    filler = cache.request("filler")
    filler.lookup([Item("reserved", (16, 16), torch.float32)], reserve_misses=True)
    closed_request = cache.request("closed")
    closed_request.close()
    closed_cache = make_cache(store=FaultInjectingStore())
    stale = closed_cache.request("stale")
    closed_cache.close()
    yield Setup(cache, trace, holder, filler, closed_request, closed_cache, stale)
    for request in (holder, filler, stale):
        request.close()
    assert_clean(cache)


T = torch.zeros(16, 16)
BAD_INPUTS: list[tuple[str, Callable[[Setup], object], type[EmbCacheError], str]] = [
    ("empty key in Item", lambda s: Item("", (4,), torch.float32), InvalidArgumentError, "empty"),
    ("int key in Item", lambda s: Item(7, (4,), torch.float32), InvalidTypeError, "str"),  # type: ignore[arg-type]
    ("empty key to remove", lambda s: s.cache.remove(""), InvalidArgumentError, "empty"),
    ("None key to remove", lambda s: s.cache.remove(None), InvalidTypeError, "str"),  # type: ignore[arg-type]
    ("bytes key to entry_state", lambda s: s.cache.entry_state(b"k"), InvalidTypeError, "str"),  # type: ignore[arg-type]
    ("empty key to insert", lambda s: s.holder.insert([""], [T]), InvalidArgumentError, "empty"),
    ("int key to insert", lambda s: s.holder.insert([1], [T]), InvalidTypeError, "str"),  # type: ignore[list-item]
    ("zero dim", lambda s: Item("k", (0, 4), torch.float32), InvalidArgumentError, "> 0"),
    ("negative dim", lambda s: Item("k", (4, -1), torch.float32), InvalidArgumentError, "> 0"),
    ("float dim", lambda s: Item("k", (4.0,), torch.float32), InvalidTypeError, "int"),  # type: ignore[arg-type]
    ("empty shape", lambda s: Item("k", (), torch.float32), InvalidTypeError, "shape"),
    ("list shape", lambda s: Item("k", [4], torch.float32), InvalidTypeError, "shape"),  # type: ignore[arg-type]
    (
        "zero-size tensor to insert",
        lambda s: s.holder.insert(["k"], [torch.empty(0, 4)]),
        InvalidArgumentError,
        "> 0",
    ),
    (
        "0-d tensor to insert",
        lambda s: s.holder.insert(["k"], [torch.tensor(1.0)]),
        InvalidTypeError,
        "shape",
    ),
    ("str dtype", lambda s: Item("k", (4,), "float32"), InvalidTypeError, "torch.dtype"),  # type: ignore[arg-type]
    ("numpy dtype", lambda s: Item("k", (4,), np.float32), InvalidTypeError, "torch.dtype"),  # type: ignore[arg-type]
    (
        "reserved shape disagrees",
        lambda s: s.filler.insert(["reserved"], [torch.zeros(8, 32)]),
        InvalidArgumentError,
        "reserved as",
    ),
    (
        "reserved dtype disagrees",
        lambda s: s.filler.insert(["reserved"], [torch.zeros(16, 16, dtype=torch.float16)]),
        InvalidArgumentError,
        "reserved as",
    ),
    (
        "reserved disagrees after a fresh key",
        lambda s: s.filler.insert(["fresh", "reserved"], [T, torch.zeros(16, 8)]),
        InvalidArgumentError,
        "reserved as",
    ),
    ("closed cache: request", lambda s: s.closed_cache.request("x"), ClosedError, "closed"),
    (
        "closed cache: lookup",
        lambda s: s.stale.lookup([slot_item("k")]),
        ClosedError,
        "cache is closed",
    ),
    (
        "closed cache: insert",
        lambda s: s.stale.insert(["k"], [T]),
        ClosedError,
        "cache is closed",
    ),
    ("closed cache: fence", lambda s: s.closed_cache.fence(), ClosedError, "closed"),
    (
        "closed request: lookup",
        lambda s: s.closed_request.lookup([slot_item("idle")]),
        ClosedError,
        "'closed' is closed",
    ),
    (
        "closed request: insert",
        lambda s: s.closed_request.insert(["k"], [T]),
        ClosedError,
        "is closed",
    ),
    (
        "closed request: embeddings",
        lambda s: s.closed_request.embeddings(),
        ClosedError,
        "is closed",
    ),
    (
        "closed request: fallback_mask",
        lambda s: s.closed_request.fallback_mask(),
        ClosedError,
        "is closed",
    ),
    (
        "duplicate open request id",
        lambda s: s.cache.request("holder"),
        RequestError,
        "already open",
    ),
    ("int request id", lambda s: s.cache.request(3), InvalidTypeError, "str"),  # type: ignore[arg-type]
    ("empty request id", lambda s: s.cache.request(""), InvalidArgumentError, "empty"),
    (
        "str in lookup",
        lambda s: s.holder.lookup(["idle"]),  # type: ignore[list-item]
        InvalidTypeError,
        "Item",
    ),
    (
        "bare Item to lookup",
        lambda s: s.holder.lookup(slot_item("idle")),  # type: ignore[arg-type]
        InvalidTypeError,
        "Item",
    ),
    (
        "non-Item after a valid Item",
        lambda s: s.holder.lookup([slot_item("idle"), ("k", (4,))]),  # type: ignore[list-item]
        InvalidTypeError,
        "Item",
    ),
    (
        "fewer tensors than keys",
        lambda s: s.holder.insert(["a", "b"], [T]),
        InvalidArgumentError,
        "as many",
    ),
    (
        "more tensors than keys",
        lambda s: s.holder.insert(["a"], [T, T]),
        InvalidArgumentError,
        "as many",
    ),
    (
        "keys given as one str",
        lambda s: s.holder.insert("ab", [T, T]),
        InvalidArgumentError,
        "list of keys",
    ),
    (
        "list instead of a tensor",
        lambda s: s.holder.insert(["k"], [[1.0, 2.0]]),  # type: ignore[list-item]
        InvalidTypeError,
        "torch.Tensor",
    ),
    (
        "non-tensor after a valid one",
        lambda s: s.holder.insert(["fresh", "k"], [T, "x"]),  # type: ignore[list-item]
        InvalidTypeError,
        "torch.Tensor",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_raises_and_changes_nothing(
    setup: Setup,
    call: Callable[[Setup], object],
    error: type[EmbCacheError],
    fragment: str,
) -> None:
    before = snapshot(setup)
    setup.cache.check_invariants()
    with pytest.raises(error) as caught:
        call(setup)
    assert type(caught.value) is error
    assert fragment in str(caught.value)
    assert snapshot(setup) == before
    setup.cache.check_invariants()
    assert setup.filler.insert(["reserved"], [T], publish=False) == [True]  # still usable


BAD_CONSTRUCTORS: list[tuple[str, dict[str, Any], type[EmbCacheError], str]] = [
    ("zero capacity", {"capacity_bytes": 0}, InvalidArgumentError, "capacity must be > 0"),
    ("negative capacity", {"capacity_bytes": -256}, InvalidArgumentError, "capacity"),
    ("str capacity", {"capacity_bytes": "1MiB"}, InvalidTypeError, "capacity"),
    ("unaligned capacity", {"capacity_bytes": 1000}, InvalidArgumentError, "multiple"),
    ("alignment not 2^n", {"alignment": 96}, InvalidArgumentError, "power of two"),
    ("alignment too small", {"alignment": 8}, InvalidArgumentError, ">= 16"),
    ("float alignment", {"alignment": 256.0}, InvalidTypeError, "alignment"),
    ("zero batch", {"max_eviction_batch": 0}, InvalidArgumentError, "max_eviction_batch"),
    ("bool batch", {"max_eviction_batch": True}, InvalidTypeError, "max_eviction_batch"),
    ("negative io_workers", {"io_workers": -1}, InvalidArgumentError, "io_workers"),
    ("float io_workers", {"io_workers": 2.0}, InvalidTypeError, "io_workers"),
    ("not a store", {"store": object()}, InvalidTypeError, "GlobalStore"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [case[1:] for case in BAD_CONSTRUCTORS],
    ids=[case[0] for case in BAD_CONSTRUCTORS],
)
def test_bad_constructor_arguments(
    kwargs: dict[str, Any], error: type[EmbCacheError], fragment: str
) -> None:
    arguments: dict[str, Any] = {"capacity_bytes": 4096, "pin_memory": False, **kwargs}
    with pytest.raises(error) as caught:
        EmbeddingCache(**arguments)
    assert type(caught.value) is error
    assert fragment in str(caught.value)


# ---------------------------------------------------------------------------- concurrency
def test_concurrent_requests_serve_only_stored_bytes(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    """Four threads look up, reserve, insert and read over a small pool; whatever is served is
    the key's own bytes, and nothing is left pinned afterwards."""
    cache = make_cache(capacity=6 * UNIT, io_workers=2)
    keys = [f"k{i}" for i in range(12)]
    for i in range(0, 12, 3):
        store.put_object(keys[i], raw(slot(i)))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for n in range(60):
                chosen = rng.sample(keys, rng.randint(1, 3))
                items = [slot_item(k) for k in chosen]
                with cache.request(f"w{seed}-{n}") as request:
                    statuses = request.lookup(items, reserve_misses=rng.random() < 0.7)
                    mine = [
                        k
                        for k, s in zip(chosen, statuses, strict=True)
                        if s.status is Status.RESERVED
                    ]
                    if mine and rng.random() < 0.9:
                        request.insert(mine, [slot(int(k[1:])) for k in mine], publish=False)
                    assert request.wait(timeout=WAIT_S)
                    for key, view in zip(chosen, request.embeddings(), strict=True):
                        if view is not None:
                            assert raw(view) == raw(slot(int(key[1:]))), key
                if rng.random() < 0.1:
                    cache.remove(rng.choice(keys))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors
    assert_clean(cache)


def test_wait_with_an_infinite_timeout_waits_until_the_load_ends(
    store: FaultInjectingStore, make_cache: Callable[..., EmbeddingCache]
) -> None:
    cache = make_cache()
    store.put_object("A", raw(slot(1)))
    store.inject("A", Fault.HOLD)
    with cache.request("r") as request:
        assert request.lookup([slot_item("A")])[0].status is Status.LOADING
        threading.Timer(0.05, store.release_holds).start()
        assert request.wait(timeout=float("inf"))
        assert request.fallback_mask().tolist() == [0]
    assert_clean(cache)


# ---------------------------------------------------------------------------- given I/O and events
class QueuedIO:
    """An I/O executor that runs nothing until asked."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.shut = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.tasks.append((fn, args))

    def run_all(self) -> None:
        while self.tasks:
            fn, args = self.tasks.pop(0)
            fn(*args)

    def shutdown(self, wait: bool = True) -> None:
        self.run_all()
        self.shut = True


def test_a_given_io_executor_runs_the_loads_and_is_shut_down_by_close(
    store: FaultInjectingStore,
) -> None:
    store.put_object("a", raw(slot(1)))
    io, made = QueuedIO(), []

    def new_event() -> threading.Event:
        made.append(threading.Event())
        return made[-1]

    cache = EmbeddingCache(1 << 20, store=store, pin_memory=False, io_executor=io,
                           new_event=new_event)
    with cache.request("r") as request:
        assert request.lookup([slot_item("a")]) == [ItemStatus(Status.LOADING)]
        assert len(io.tasks) == 1 and not request.wait(timeout=0)  # nothing ran the load yet
        assert len(made) == 1 and not made[0].is_set()
        io.run_all()
        assert made[0].is_set() and request.wait(timeout=0)
        view = request.embeddings()[0]
        assert view is not None and torch.equal(view, slot(1))
    cache.close()
    assert io.shut


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"io_executor": object()}, "io_executor must have submit"), ({"new_event": 3}, "new_event")],
)
def test_a_bad_io_executor_or_event_factory_is_refused(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidTypeError, match=words):
        EmbeddingCache(1 << 16, pin_memory=False, **kwargs)
