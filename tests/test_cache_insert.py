"""``EmbeddingCache.insert``: a request-less batch insert (SGLang's ``store_to_pool_async``)."""

from __future__ import annotations

import pytest
import torch

from embcache import EmbeddingCache, Item, Status
from embcache.core.lifecycle import LOADING, READY
from embcache.driver.trace import TraceLog
from embcache.errors import ClosedError, InvalidArgumentError
from embcache.testing import FaultInjectingStore
from tests.support.helpers import payload, raw, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("poison_modes")]

UNIT = 1024  # one 256 float32 slot


def slot(seed: int) -> torch.Tensor:
    return payload((UNIT // 4,), torch.float32, seed)


def item(key: str) -> Item:
    return Item(key, (UNIT // 4,), torch.float32)


def test_inserted_entries_are_idle_and_read_back_with_their_bytes_and_dtype() -> None:
    with EmbeddingCache(4 * UNIT, pin_memory=False) as cache:
        half = payload((UNIT // 2,), torch.bfloat16, 7)
        assert cache.insert(["a", "b"], [slot(1), half], publish=False) == [True, True]
        stats = cache.stats()
        assert stats.entries == 2 and stats.pinned_entries == 0 and stats.open_requests == 0
        assert stats.inserts == 2
        with cache.request("r") as request:
            statuses = request.lookup([item("a"), Item("b", (UNIT // 2,), torch.bfloat16)])
            assert [s.status for s in statuses] == [Status.HIT, Status.HIT]
            a, b = request.embeddings()
            assert a is not None and torch.equal(a, slot(1))
            assert b is not None and b.dtype is torch.bfloat16 and raw(b) == raw(half)
        cache.check_invariants()


def test_present_duplicate_and_reserved_keys_are_left_alone() -> None:
    with EmbeddingCache(8 * UNIT, pin_memory=False) as cache:
        assert cache.insert(["a"], [slot(1)], publish=False) == [True]
        with cache.request("r") as request:
            assert request.lookup([item("z")], reserve_misses=True)[0].status is Status.RESERVED
            results = cache.insert(["a", "n", "n", "z"], [slot(2), slot(3), slot(4), slot(5)],
                                   publish=False)
            assert results == [False, True, False, False]
            assert cache.entry_state("z") is LOADING  # still the request's reservation
            assert request.insert(["z"], [slot(5)], publish=False) == [True]
        with cache.request("check") as request:
            request.lookup([item("a"), item("n")])
            a, n = request.embeddings()
            assert a is not None and torch.equal(a, slot(1))  # the first insert's bytes stay
            assert n is not None and torch.equal(n, slot(3))  # a duplicate key: the first one
        cache.check_invariants()


def test_a_full_pool_evicts_idle_entries_oldest_first() -> None:
    with EmbeddingCache(2 * UNIT, pin_memory=False, policy="lru") as cache:
        assert cache.insert(["a", "b"], [slot(1), slot(2)], publish=False) == [True, True]
        assert cache.insert(["c"], [slot(3)], publish=False) == [True]
        assert cache.entry_state("a").name == "ABSENT" and cache.entry_state("c") is READY
        assert cache.stats().evictions == 1
        cache.check_invariants()


def test_publish_writes_each_cached_entry_to_the_store() -> None:
    store = FaultInjectingStore(delay_seconds=0.0)
    with EmbeddingCache(4 * UNIT, store=store, pin_memory=False) as cache:
        assert cache.insert(["a", "b"], [slot(1), slot(2)]) == [True, True]
        wait_until(lambda: cache.stats().publishes_ok == 2, "both publishes")
        assert store.object("a") == raw(slot(1)) and store.object("b") == raw(slot(2))
        wait_until(lambda: cache.stats().pinned_entries == 0, "the publish pins to go")
        cache.check_invariants()


def test_the_trace_shows_an_internal_request_around_the_actions() -> None:
    trace = TraceLog()
    with EmbeddingCache(4 * UNIT, pin_memory=False, trace=trace) as cache:
        cache.insert(["a"], [slot(1)], publish=False)
    actions = [(e["action"], e["request"]) for e in trace.events[1:]]
    assert actions == [
        ("OpenRequest", "insert#1"),
        ("BeginLoad", "insert#1"),
        ("EndLoad", None),
        ("Release", "insert#1"),
        ("CloseRequest", "insert#1"),
    ]
    assert [e["seq"] for e in trace.events] == list(range(1, 7))


def test_bad_input_is_refused_and_changes_nothing() -> None:
    cache = EmbeddingCache(4 * UNIT, pin_memory=False)
    with pytest.raises(InvalidArgumentError, match="list of keys"):
        cache.insert("a", [slot(1)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="list of keys"):
        cache.insert(["a", "b"], [slot(1)])
    assert cache.stats().entries == 0 and cache.stats().open_requests == 0
    cache.close()
    with pytest.raises(ClosedError):
        cache.insert(["a"], [slot(1)])


UNIT = 256  # the alignment: every entry below is a whole number of units


@pytest.mark.parametrize(
    ("layout", "removed", "units"),
    [
        ("1111", "", 1),  # the victim's range exactly: no allocator call at all
        ("211", "1", 2),  # the same, with a free block after the victim (left as it was)
        ("121", "0", 2),  # a free block before the victim: the span starts there
        ("211", "", 1),  # a victim larger than the insert: the rest of its range is freed
    ],
)
def test_an_evicting_insert_leaves_the_allocator_as_freeing_and_allocating_would(
    layout: str, removed: str, units: int
) -> None:
    """An insert that must evict one idle entry: the pool ends exactly as if the victim's
    range had been freed and the new one allocated best-fit (same offset, same free and
    allocated blocks), whether or not the victim's range passes straight to the new entry.
    ``layout``: entry sizes in units, inserted (and idle) in order, the first the LRU victim;
    ``removed``: the indexes of the entries removed first, leaving free blocks."""
    capacity = sum(int(size) for size in layout) * UNIT
    with EmbeddingCache(
        capacity, alignment=UNIT, pin_memory=False, auto_fence=None, policy="lru"
    ) as cache:
        keys = [f"e{i}" for i in range(len(layout))]
        for key, size in zip(keys, layout, strict=True):
            tensor = payload((int(size) * UNIT // 2,), torch.bfloat16, int(size))
            assert cache.insert([key], [tensor]) == [True]
        for i in removed:
            assert cache.remove(keys[int(i)])
        before = cache.snapshot()
        victim = before.entries[before.eviction_order[0]]
        expected = before.allocator  # a copy: free the victim, then allocate best-fit
        expected.free(victim.offset)
        offset = expected.allocate(units * UNIT)
        tensor = payload((units * UNIT // 2,), torch.bfloat16, 7)
        assert cache.insert(["new"], [tensor]) == [True]
        with cache.request("check") as request:  # the new entry holds its own bytes
            request.lookup([Item("new", tuple(tensor.shape), tensor.dtype)])
            assert raw(request.embeddings()[0]) == raw(tensor)
        after = cache.snapshot()
        assert victim.key not in after.entries
        assert after.entries["new"].offset == offset
        assert after.allocator.allocations() == expected.allocations()
        assert after.allocator.free_blocks() == expected.free_blocks()
        cache.check_invariants()
