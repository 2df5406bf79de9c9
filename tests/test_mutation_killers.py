"""Tests added to kill mutants that survived the mutation run (tests/mutation/REPORT.md).

Each test names the mutants it kills. The eviction ones compare ``best_window`` and
``neighbourhood`` with brute-force references over random inputs; the others pin down error
messages, ``block_before`` on free blocks and interior offsets, a store that answers a publish
with the wrong number of codes, and a timed-out ``wait_async`` dropping its future. Two tests
reach into private state (``_requests``) where the only effect of the mutant is a leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from embcache import EmbeddingCache, Item, Reason, Status
from embcache.core.eviction import Piece, Window, best_window, neighbourhood
from embcache.core.invariants import check_core
from embcache.core.lifecycle import ABSENT, LOADING, QUARANTINED, READY, Step, transition
from embcache.driver.allocator import Block, RangeAllocator
from embcache.driver.locks import HierarchyLock, lock_checking_enabled
from embcache.driver.trace import TraceLog
from embcache.errors import (
    ClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    LockOrderError,
    NotAllocatedError,
    TransitionError,
)
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import wait_until

pytestmark = pytest.mark.timeout(60)

ALIGN = 256


# ------------------------------------------------------------------ allocator
def test_size_of_names_the_bad_argument() -> None:
    """Kills allocator size_of__mutmut_1/5/6 (the argument name in the message)."""
    allocator = RangeAllocator(4 * ALIGN, ALIGN)
    with pytest.raises(InvalidTypeError, match=r"^offset must be an int, got str 'x'$"):
        allocator.size_of("x")  # type: ignore[arg-type]


def test_not_allocated_message_is_exact() -> None:
    """Kills allocator _not_allocated_message__mutmut_* (the message text)."""
    allocator = RangeAllocator(4 * ALIGN, ALIGN)
    message = (
        f"offset {ALIGN} is not the start of a live allocation (double free, interior "
        "offset, or never allocated)"
    )
    for call in (allocator.size_of, allocator.free):
        with pytest.raises(NotAllocatedError, match=f"^{re.escape(message)}$"):
            call(ALIGN)


def test_block_before_reports_free_blocks_and_only_block_boundaries() -> None:
    """Kills allocator block_before__mutmut_2 (free flag) and __mutmut_26 (interior offsets)."""
    allocator = RangeAllocator(8 * ALIGN, ALIGN)
    a = allocator.allocate(ALIGN)
    b = allocator.allocate(2 * ALIGN)
    c = allocator.allocate(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    allocator.free(b)
    assert allocator.block_before(0) is None
    assert allocator.block_before(ALIGN) == Block(0, ALIGN, False)
    assert allocator.block_before(3 * ALIGN) == Block(ALIGN, 2 * ALIGN, True)
    assert allocator.block_before(4 * ALIGN) == Block(3 * ALIGN, ALIGN, False)
    assert allocator.block_before(8 * ALIGN) == Block(4 * ALIGN, 4 * ALIGN, True)
    for interior in (2 * ALIGN, 5 * ALIGN, ALIGN + 16):
        assert allocator.block_before(interior) is None


# ------------------------------------------------------------------ eviction: best_window
def reference_best_window(
    pieces: list[Piece], need: int, max_batch: int, must: int
) -> Window | None:
    """Every run of consecutive victims containing ``must``: fewest victims, bytes, offset."""
    victims = [i for i, p in enumerate(pieces) if p.victim]
    last_end = pieces[-1].offset + pieces[-1].size
    best: tuple[tuple[int, int, int], Window] | None = None
    for a in range(len(victims)):
        for b in range(a, min(len(victims), a + max_batch)):
            if not victims[a] <= must <= victims[b]:
                continue
            before = pieces[victims[a - 1]] if a > 0 else None
            start = before.offset + before.size if before else pieces[0].offset
            end = pieces[victims[b + 1]].offset if b + 1 < len(victims) else last_end
            if end - start < need:
                continue
            chosen = [pieces[i] for i in victims[a : b + 1]]
            window = Window(
                tuple(p.offset for p in chosen), sum(p.size for p in chosen), start, end - start
            )
            key = (len(chosen), window.victim_bytes, start)
            if best is None or key < best[0]:
                best = (key, window)
    return None if best is None else best[1]


@st.composite
def window_problems(draw: st.DrawFn) -> tuple[list[Piece], int, int, int]:
    n = draw(st.integers(1, 9))
    kinds = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    for i in range(1, n):  # free pieces are never adjacent
        if not kinds[i] and not kinds[i - 1]:
            kinds[i] = True
    if not any(kinds):
        kinds[0] = True
    sizes = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    offset = draw(st.integers(0, 4)) * ALIGN
    pieces = []
    for victim, size in zip(kinds, sizes, strict=True):
        pieces.append(Piece(offset, size * ALIGN, victim))
        offset += size * ALIGN
    must = draw(st.sampled_from([i for i, p in enumerate(pieces) if p.victim]))
    need = draw(st.integers(1, sum(sizes) + 1)) * ALIGN - draw(st.integers(0, ALIGN - 1))
    return pieces, need, draw(st.integers(1, 4)), must


@given(window_problems())
def test_best_window_matches_brute_force(problem: tuple[list[Piece], int, int, int]) -> None:
    """Kills eviction best_window mutants (window bounds, span, victim bytes, search range)."""
    pieces, need, max_batch, must = problem
    assert best_window(pieces, need, max_batch, must) == reference_best_window(
        pieces, need, max_batch, must
    )


def test_best_window_examples() -> None:
    """Hand-made cases of the same mutants, readable when one fails."""
    k = ALIGN
    # The victim before `must` is big, `must` alone is too small: no window without `must`.
    pieces = [Piece(0, 10 * k, True), Piece(10 * k, k, True)]
    assert best_window(pieces, 10 * k, 1, 1) is None
    assert best_window(pieces, 11 * k, 2, 1) == Window((0, 10 * k), 11 * k, 0, 11 * k)
    # The victim after `must` is big: the window must still contain `must`.
    pieces = [Piece(0, k, True), Piece(k, 10 * k, True)]
    assert best_window(pieces, 10 * k, 1, 0) is None
    # count 2: the first run (v0, v1) is too small, the second (v1, v2) fits.
    pieces = [
        Piece(k, k, True),
        Piece(2 * k, k, True),
        Piece(3 * k, k, True),
        Piece(4 * k, 9 * k, False),
    ]
    assert best_window(pieces, 11 * k, 3, 1) == Window((2 * k, 3 * k), 2 * k, 2 * k, 11 * k)
    # More victims than max_batch would be needed: nothing.
    assert best_window(pieces, 12 * k, 2, 1) is None
    # The span starts after the victim before the run (two victims before it).
    pieces = [
        Piece(0, k, True),
        Piece(k, 2 * k, True),
        Piece(3 * k, k, True),
        Piece(4 * k, 3 * k, False),
    ]
    assert best_window(pieces, 4 * k, 1, 2) == Window((3 * k,), k, 3 * k, 4 * k)


# ------------------------------------------------------------------ eviction: neighbourhood
def reference_neighbourhood(
    allocator: RangeAllocator, candidate: Block, max_batch: int, candidates: set[int]
) -> tuple[list[Piece], int]:
    blocks = sorted(
        [Block(o, s, True) for o, s in allocator.free_blocks()]
        + [Block(o, s, False) for o, s in allocator.allocations()]
    )
    at = blocks.index(candidate)

    def walk(indices: range) -> list[Piece]:
        out, victims = [], 0
        for i in indices:
            block = blocks[i]
            if block.free:
                out.append(Piece(block.offset, block.size, False))
            elif block.offset in candidates:
                if victims == max_batch - 1:
                    break
                victims += 1
                out.append(Piece(block.offset, block.size, True))
            else:
                break
        return out

    left = walk(range(at - 1, -1, -1))[::-1]
    right = walk(range(at + 1, len(blocks)))
    return [*left, Piece(candidate.offset, candidate.size, True), *right], len(left)


@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=12),
    freed=st.lists(st.booleans(), min_size=12, max_size=12),
    chosen=st.lists(st.booleans(), min_size=12, max_size=12),
    which=st.integers(0, 11),
    max_batch=st.integers(1, 4),
)
def test_neighbourhood_matches_brute_force(
    sizes: list[int], freed: list[bool], chosen: list[bool], which: int, max_batch: int
) -> None:
    """Kills eviction neighbourhood mutants (free pieces, victim counting, the right side)."""
    allocator = RangeAllocator(sum(sizes) * ALIGN + 2 * ALIGN, ALIGN)
    offsets = [allocator.allocate(s * ALIGN) for s in sizes]
    live = []
    for i, offset in enumerate(offsets):
        assert offset is not None
        if freed[i] and i != which % len(offsets):
            allocator.free(offset)
        else:
            live.append(offset)
    candidate_offset = offsets[which % len(offsets)]
    assert candidate_offset is not None
    candidates = {o for i, o in enumerate(live) if chosen[i]} | {candidate_offset}
    candidate = allocator.block_at(candidate_offset)
    assert candidate is not None
    got = neighbourhood(
        candidate, max_batch, allocator.block_before, allocator.block_at, candidates.__contains__
    )
    assert got == reference_neighbourhood(allocator, candidate, max_batch, candidates)


def all_layouts(max_len: int) -> list[str]:
    """Every row of blocks: F free, C candidate, O other allocated; no two F adjacent."""
    rows = [""]
    out = []
    for _ in range(max_len):
        rows = [r + k for r in rows for k in "FCO" if not (k == "F" and r.endswith("F"))]
        out += [r for r in rows if "C" in r]
    return out


def test_neighbourhood_matches_brute_force_on_every_small_layout() -> None:
    """Kills eviction neighbourhood mutants deterministically (victim counting on each side)."""
    checked = 0
    for row in all_layouts(6):
        sizes = [(i % 2 + 1) * ALIGN for i in range(len(row))]
        allocator = RangeAllocator(sum(sizes), ALIGN)
        offsets = [allocator.allocate(size) for size in sizes]
        for kind, offset in zip(row, offsets, strict=True):
            assert offset is not None
            if kind == "F":
                allocator.free(offset)
        candidates = {o for k, o in zip(row, offsets, strict=True) if k == "C"}
        for at in (i for i, k in enumerate(row) if k == "C"):
            candidate = allocator.block_at(offsets[at])  # type: ignore[arg-type]
            assert candidate is not None
            for max_batch in (1, 2, 3, 4):
                got = neighbourhood(
                    candidate,
                    max_batch,
                    allocator.block_before,
                    allocator.block_at,
                    candidates.__contains__,
                )
                want = reference_neighbourhood(allocator, candidate, max_batch, candidates)
                assert got == want, (row, at, max_batch)
                checked += 1
    assert checked > 5000


# ------------------------------------------------------------------ controller
def test_fence_refuses_to_call_the_store_under_a_lock() -> None:
    """Kills cache fence__mutmut_3/4/5 (what the LockOrderError says is being done)."""
    if not lock_checking_enabled():
        pytest.skip("needs EMBCACHE_LOCK_CHECK=1")
    cache = EmbeddingCache(4 * ALIGN, pin_memory=False)
    try:
        outer = HierarchyLock(0, "test outer lock")
        with outer, pytest.raises(LockOrderError, match=r"^store fence while holding test outer"):
            cache.fence()
        assert cache.fence() == 0
    finally:
        cache.close()


class MiscountingStore(FaultInjectingStore):
    """A store whose ``put_from`` answers one code too many."""

    def put_from(self, keys, offsets, sizes):  # type: ignore[no-untyped-def]
        return [*super().put_from(keys, offsets, sizes), 0]


def test_publish_answered_with_the_wrong_number_of_codes_is_unknown() -> None:
    """Kills cache _run_publishes__mutmut_17 (no outcomes when the count is wrong)."""
    store = MiscountingStore()
    cache = EmbeddingCache(8 * ALIGN, store=store, pin_memory=False)
    try:
        tensor = torch.arange(64, dtype=torch.float32)
        with cache.request("r") as request:
            assert request.insert(["k"], [tensor], publish=True) == [True]
            deadline = time.monotonic() + 10
            while cache.stats().publishes_unknown == 0:
                assert time.monotonic() < deadline, cache.stats()
                time.sleep(0.002)
        stats = cache.stats()
        assert (stats.publishes_started, stats.publishes_unknown, stats.publishes_ok) == (1, 1, 0)
        assert cache.entry_state("k") is QUARANTINED  # tainted: the last pin quarantined it
        assert cache.fence() == 1
        cache.check_invariants()
    finally:
        cache.close()


def test_timed_out_async_wait_drops_its_future() -> None:
    """Kills cache _wait_async__mutmut_11 (a timed-out waiter left in async_waiters)."""
    store = FaultInjectingStore()
    tensor = torch.arange(64, dtype=torch.float32)
    store.put_object("k", tensor.numpy().tobytes())
    store.inject("k", Fault.HOLD)
    cache = EmbeddingCache(8 * ALIGN, store=store, pin_memory=False)
    try:
        with cache.request("r") as request:
            request.lookup([Item("k", (64,), torch.float32)])
            assert asyncio.run(request.wait_async(timeout=0.01)) is False
            assert cache.sizes()["async_waiters"] == 0
            store.release_holds()
            assert request.wait(timeout=10)
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


def test_trace_events_of_a_failed_allocation_a_publish_and_a_remove() -> None:
    """Kills cache _alloc_failed__mutmut_7..20, _publish__mutmut_29/33, _end_publish__mutmut_24/29,
    _remove__mutmut_25/29 (trace events with wrong fields) and _publish__mutmut_21 (the count).
    """
    trace: list[dict[str, object]] = []
    cache = EmbeddingCache(4 * ALIGN, store=FaultInjectingStore(), pin_memory=False, trace=trace)
    try:
        small = torch.arange(64, dtype=torch.float32)  # one ALIGN
        with cache.request("r") as request:
            assert request.insert(["a", "b"], [small, small + 1], publish=True) == [True, True]
            wait_until(lambda: cache.stats().publishes_ok == 2, "two publishes")
            assert cache.stats().publishes_started == 2
            publish = [e for e in trace if e["action"] == "Publish"]
            assert [(e["request"], e["key"], e["state"]) for e in publish] == [
                ("r", "a", "READY"),
                ("r", "b", "READY"),
            ]
            assert all(e["holders"] == ["publish:r", "r"] for e in publish)
            assert all(e["size"] == ALIGN for e in publish)
            ended = [e for e in trace if e["action"] == "EndPublish"]
            assert sorted((e["key"], e["outcome"], e["holders"]) for e in ended) == [
                ("a", "OK", ["r"]),
                ("b", "OK", ["r"]),
            ]
            assert all(e["size"] == ALIGN and e["state"] == "READY" for e in ended)
            with cache.request("big") as other:
                big = Item("c", (3 * 64,), torch.float32)  # 3 * ALIGN: only 2 free, 2 pinned
                assert other.lookup([big], prefetch=False, reserve_misses=True)[0].reason.name == (
                    "NO_SPACE"
                )
            failed = [e for e in trace if e["action"] == "BeginLoad" and e["key"] == "c"]
            assert [{k: v for k, v in e.items() if k != "seq"} for e in failed] == [
                {
                    "action": "BeginLoad",
                    "request": "big",
                    "key": "c",
                    "outcome": "NO_SPACE",
                    "size": 3 * ALIGN,
                }
            ]
        assert cache.remove("a") is True
        removed = trace[-1]
        assert (removed["action"], removed["key"], removed["request"]) == ("Remove", "a", None)
        assert (removed["size"], removed["offset"], removed["state"]) == (ALIGN, 0, "ABSENT")
        cache.check_invariants()
    finally:
        cache.close()


def test_duplicate_keys_in_one_insert_do_not_stop_the_rest() -> None:
    """Kills cache _insert__mutmut_28 (a duplicate key ends the insert)."""
    cache = EmbeddingCache(8 * ALIGN, pin_memory=False)
    try:
        t = torch.arange(64, dtype=torch.float32)
        with cache.request("r") as request:
            assert request.insert(["a", "a", "b"], [t, t, t + 1]) == [True, False, True]
            assert request.lookup([Item("b", (64,), torch.float32)])[0].status.name == "HIT"
            assert torch.equal(request.embeddings()[0], t + 1)
        cache.check_invariants()
    finally:
        cache.close()


def test_insert_argument_messages() -> None:
    """Kills item check_key__mutmut_3/6 (was cache _check_key) and _insert__mutmut_4 (messages)."""
    cache = EmbeddingCache(8 * ALIGN, pin_memory=False)
    try:
        t = torch.arange(64, dtype=torch.float32)
        with cache.request("r") as request:
            with pytest.raises(InvalidTypeError, match=r"^key must be a str, got int$"):
                request.insert([5], [t])  # type: ignore[list-item]
            with pytest.raises(InvalidArgumentError, match=r"^key must be a non-empty str$"):
                request.insert([""], [t])
            message = "insert takes a list of keys and a list of as many tensors"
            with pytest.raises(InvalidArgumentError, match=f"^{message}$"):
                request.insert("ab", [t])  # type: ignore[arg-type]
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("call", ["wait", "insert", "close", "lookup"])
def test_blocking_work_under_a_lock_names_what_it_was(call: str) -> None:
    """Kills cache _wait__mutmut_1-3, _copy_in__mutmut_1-3, close__mutmut_3-6 and (session 2)
    _lookup_items__mutmut_28-30 (what the LockOrderError says is being done)."""
    if not lock_checking_enabled():
        pytest.skip("needs EMBCACHE_LOCK_CHECK=1")
    what = {
        "wait": "request wait",
        "insert": "payload copy",
        "close": "waiting for I/O workers",
        "lookup": "store exists",
    }[call]
    io = ThreadPoolExecutor(4, "embcache-io")
    cache = EmbeddingCache(
        8 * ALIGN, store=FaultInjectingStore(), pin_memory=False, io_executor=io
    )
    outer = HierarchyLock(0, "test outer lock")
    t = torch.arange(64, dtype=torch.float32)
    try:
        with (
            cache.request("r") as request,
            outer,
            pytest.raises(LockOrderError, match=f"^{re.escape(what)} while holding"),
        ):
            if call == "wait":
                request.wait(timeout=0)
            elif call == "lookup":  # a miss, prefetched: the store is asked between two holds
                request.lookup([Item("k", (64,), torch.float32)])
            elif call == "insert":
                request.insert(["k"], [t])
            else:
                cache.close()
        if call == "close":
            io.shutdown(wait=True)  # close() stopped before waiting for its workers
        else:
            cache.check_invariants()
    finally:
        cache.close()


# ------------------------------------------------------------------ state machine messages
def test_transition_error_lists_what_the_state_allows() -> None:
    """Kills states x_transition__mutmut_4..10 (the TransitionError message)."""
    with pytest.raises(TransitionError) as info:
        transition(QUARANTINED, Step.LOOKUP_HIT)
    assert str(info.value) == (
        "Lookup (LOOKUP_HIT) is not allowed in state QUARANTINED; allowed there: FENCE"
    )
    with pytest.raises(TransitionError) as info:
        transition(ABSENT, Step.EVICT)
    assert (
        str(info.value) == "Evict (EVICT) is not allowed in state ABSENT; allowed there: BEGIN_LOAD"
    )
    with pytest.raises(TransitionError) as info:
        transition(READY, Step.FENCE)
    assert str(info.value) == (
        "Fence (FENCE) is not allowed in state READY; allowed there: END_PUBLISH, EVICT, "
        "LOOKUP_HIT, PUBLISH, RELEASE_LAST_DOOMED, RELEASE_LAST_TAINTED, RELEASE_PIN, "
        "REMOVE_BUSY, REMOVE_IDLE"
    )


def test_closed_and_request_id_messages() -> None:
    """Kills cache _check_open__mutmut_2/3 and request__mutmut_5 (error messages)."""
    cache = EmbeddingCache(4 * ALIGN, pin_memory=False)
    with pytest.raises(InvalidArgumentError, match=r"^request_id must be a non-empty str$"):
        cache.request("")
    cache.close()
    with pytest.raises(ClosedError, match=r"^the cache is closed: create a new EmbeddingCache$"):
        cache.request("r")


def test_stats_fragmentation_when_full_and_pin_age() -> None:
    """Kills cache stats__mutmut_74 (fragmentation of a full pool) and __mutmut_82 (pin age)."""
    cache = EmbeddingCache(ALIGN, pin_memory=False)
    try:
        with cache.request("r") as request:
            assert request.insert(["a"], [torch.arange(64, dtype=torch.float32)]) == [True]
            stats = cache.stats()
            assert stats.free_bytes == 0 and stats.fragmentation == 0.0
            assert 0.0 <= stats.oldest_pin_age_s < 30.0
    finally:
        cache.close()


# ------------------------------------------------------------------ wake-ups
def held_cache(keys: list[str]) -> tuple[EmbeddingCache, FaultInjectingStore]:
    store = FaultInjectingStore()
    for key in keys:
        store.put_object(key, torch.arange(64, dtype=torch.float32).numpy().tobytes())
        store.inject(key, Fault.HOLD)
    return EmbeddingCache(16 * ALIGN, store=store, pin_memory=False), store


def test_one_completion_wakes_every_async_waiter() -> None:
    """Kills cache _signal__mutmut_6 (the wake list of one request replaces the others')."""
    cache, store = held_cache(["k"])
    item = Item("k", (64,), torch.float32)
    try:
        requests = [cache.request(f"r{i}") for i in range(3)]
        for request in requests:
            request.lookup([item])

        async def wait_all() -> list[bool]:
            waits = [asyncio.ensure_future(r.wait_async(timeout=10)) for r in requests]
            while cache.sizes()["async_waiters"] < 3:  # one future of each request
                await asyncio.sleep(0.001)
            store.release_holds()
            return list(await asyncio.gather(*waits))

        assert asyncio.run(wait_all()) == [True, True, True]
        for request in requests:
            request.close()
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


def test_abandoning_two_reservations_wakes_both_waiters() -> None:
    """Kills cache _close__mutmut_5 (only the last abandoned reservation's waiters woken)."""
    cache, _store = held_cache([])
    x, y = Item("x", (64,), torch.float32), Item("y", (64,), torch.float32)
    try:
        owner = cache.request("owner")
        assert [s.status.name for s in owner.lookup([x, y], reserve_misses=True)] == [
            "RESERVED",
            "RESERVED",
        ]
        with cache.request("wx") as wx, cache.request("wy") as wy:
            assert wx.lookup([x])[0].status.name == "LOADING"
            assert wy.lookup([y])[0].status.name == "LOADING"
            owner.close()
            assert wx.wait(timeout=5) and wy.wait(timeout=5)
            assert wx.fallback_reasons() == [Reason.ABANDONED]
            assert wy.fallback_reasons() == [Reason.ABANDONED]
        cache.check_invariants()
    finally:
        cache.close()


def test_a_load_nobody_waits_for_any_more_becomes_evictable() -> None:
    """Kills cache _end_load__mutmut_39 (the idle READY entry never reaches the LRU)."""
    cache, store = held_cache(["k"])
    try:
        with cache.request("r") as request:
            assert request.lookup([Item("k", (64,), torch.float32)])[0].status.name == "LOADING"
        store.release_holds()
        wait_until(lambda: cache.entry_state("k") is not LOADING, "the load to end")
        assert cache.entry_state("k") is READY
        stats = cache.stats()
        assert stats.pinned_entries == 0 and stats.loads_ok == 1
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


def test_trace_fields_of_waiters_doomed_and_tainted() -> None:
    """Kills cache _emit__mutmut_21..23/28..30 and _end_load__mutmut_53 (event fields)."""
    trace: list[dict[str, object]] = []
    store = FaultInjectingStore()
    store.put_object("k", torch.arange(64, dtype=torch.float32).numpy().tobytes())
    store.inject("k", Fault.HOLD)
    cache = EmbeddingCache(8 * ALIGN, store=store, pin_memory=False, trace=trace)
    try:
        with cache.request("r") as request:
            request.lookup([Item("k", (64,), torch.float32)])
            assert cache.remove("k") is True  # busy: doomed
            store.release_holds()
            assert request.wait(timeout=10)
        begin = next(e for e in trace if e["action"] == "BeginLoad")
        assert (begin["waiters"], begin["doomed"], begin["tainted"]) == (["r"], False, False)
        remove = next(e for e in trace if e["action"] == "Remove")
        assert (remove["state"], remove["waiters"], remove["doomed"]) == ("LOADING", ["r"], True)
        end = next(e for e in trace if e["action"] == "EndLoad")
        assert (end["state"], end["waiters"], end["doomed"], end["tainted"]) == (
            "ABSENT",
            [],
            False,
            False,
        )
        assert end["doomed"] is False and end["tainted"] is False
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


# ------------------------------------------------------------------ the invariant checker
def state_copy(cache: EmbeddingCache) -> dict[str, Any]:
    """A copy of the cache core's state, as ``check_core`` takes it (``snapshot``): corrupt
    the copy, never the core."""
    snap = cache.snapshot()
    return {
        "allocator": snap.allocator,
        "entries": snap.entries,
        "pinned_since": snap.pinned_since,
        "requests": snap.requests,
        "order": snap.eviction_order,
        "evictable_bytes": snap.evictable_bytes,
        "quarantine": snap.quarantine,
    }


def corrupt_and_check(corrupt: str) -> str:
    """Build idle, held, loading and quarantined entries, break one invariant in a copy of the
    state, return the error ``check_core`` (what ``check_invariants`` runs) raises for it."""
    store = FaultInjectingStore()
    store.put_object("q", torch.arange(64, dtype=torch.float32).numpy().tobytes())
    store.inject("q", Fault.UNKNOWN)
    cache = EmbeddingCache(16 * ALIGN, store=store, pin_memory=False)
    t = torch.arange(64, dtype=torch.float32)
    try:
        with cache.request("setup") as setup:
            assert setup.insert(["idle"], [t], publish=False) == [True]
            setup.lookup([Item("q", (64,), torch.float32)])
            assert setup.wait(timeout=10)
        assert cache.entry_state("q") is QUARANTINED
        r = cache.request("r")
        assert r.insert(["held"], [t], publish=False) == [True]
        assert r.lookup([Item("loading", (64,), torch.float32)], reserve_misses=True)[
            0
        ].status.name == ("RESERVED")
        s = cache.request("s")
        cache.check_invariants()
        state = state_copy(cache)
        check_core(**state)  # the copy is as sound as the core
        e, rs = state["entries"], state["requests"]
        if corrupt == "allocation":
            state["allocator"].allocate(ALIGN)
        elif corrupt == "pin_times":
            state["pinned_since"]["idle"] = 0.0
        elif corrupt == "reserved_not_waited":
            rs["r"].reserved.add("held")
        elif corrupt == "reserved_not_filled":  # FillsExact: a reservation someone else fills
            e["loading"].filler = "s"
        elif corrupt == "filled_not_reserved":  # FillsExact: a fill nobody reserved
            rs["r"].reserved.discard("loading")
        elif corrupt == "holder":
            e["idle"].holders |= {"s"}
        elif corrupt == "publishing":
            e["held"].publishing = True
        elif corrupt == "waiter":
            e["loading"].waiters |= {"s"}
        elif corrupt == "loading_pinned":
            e["loading"].holders |= {"s"}
            rs["s"].holds["loading"] = None
        elif corrupt == "filler":
            e["idle"].filler = "r"
        elif corrupt == "quarantine_list":
            state["quarantine"].pop("q")
        elif corrupt == "quarantined_doomed":
            e["q"].doomed = True
        elif corrupt == "doomed_idle":
            e["idle"].doomed = True
        elif corrupt == "tainted_idle":
            e["idle"].tainted = True
        elif corrupt == "lru":
            state["order"].remove("idle")
        elif corrupt == "evictable_bytes":
            state["evictable_bytes"] += 1
        elif corrupt == "fenced_not_quarantined":
            state["fencing"] = [(e["q"],)]  # a fence in flight took q; something else ended it
            e["q"].state = READY
        del s
        with pytest.raises(InvariantError) as info:
            check_core(**state)
        cache.check_invariants()  # the core itself was never touched
        return str(info.value)
    finally:
        store.release_holds()
        cache.close()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        ("allocation", r"allocations \[.*\] != entry ranges \[.*\]"),
        ("fenced_not_quarantined", r"'q' is READY while a fence in flight holds it"),
        ("pin_times", r"pin start times kept for \['held', 'idle'\], not for the pinned entries"),
        ("reserved_not_waited", r"request 'r' bookkeeping inconsistent"),
        ("reserved_not_filled", r"request 'r' reserved 'loading', which it does not fill"),
        ("filled_not_reserved", r"'loading' is filled by 'r', which has not reserved it"),
        ("holder", r"'idle' holders (frozenset\()?\{'s'\}\)? != requests holding it set\(\)"),
        ("publishing", r"'held' publish pins set\(\) but publishing=True"),
        (
            "waiter",
            r"'loading' waiters (frozenset\()?\{'[rs]', '[rs]'\}\)? != requests waiting \{'r'\}",
        ),
        ("loading_pinned", r"LOADING 'loading' has pin holders"),
        ("filler", r"READY 'idle' has waiters or a filler"),
        ("quarantined_doomed", r"QUARANTINED 'q' is pinned or doomed"),
        ("quarantine_list", r"quarantine list \[\] != QUARANTINED entries \['q'\]"),
        ("doomed_idle", r"doomed 'idle' is idle"),
        ("tainted_idle", r"tainted 'idle' is not pinned \(it should be QUARANTINED\)"),
        ("lru", r"eviction order \[\] != evictable \['idle'\]"),
        ("evictable_bytes", r"evictable byte count drifted"),
    ],
)
def test_check_invariants_names_each_corruption(corrupt: str, message: str) -> None:
    """Kills cache _check_invariants_locked mutants: each check fires, with its own message."""
    assert re.fullmatch("cache invariant broken: " + message, corrupt_and_check(corrupt))


# ------------------------------------------------------------------ construction and ownership
def test_lock_names_in_a_hierarchy_violation() -> None:
    """Kills allocator __init____mutmut_30/33/34, cache __init____mutmut_33/36/37 (lock names)."""
    if not lock_checking_enabled():
        pytest.skip("needs EMBCACHE_LOCK_CHECK=1")
    cache = EmbeddingCache(4 * ALIGN, pin_memory=False)
    allocator = RangeAllocator(4 * ALIGN)  # the public allocator's lock: level 2
    try:
        with (
            allocator.lock,  # the allocator's own lock, whose name is what this kills
            pytest.raises(
                LockOrderError,
                match=r"^taking cache lock \(level 1\) while holding allocator lock \(level 2\)",
            ),
        ):
            cache.stats()
    finally:
        cache.close()


def test_constructor_messages_and_the_smallest_alignment() -> None:
    """Kills cache __init____mutmut_5/7/18/19/25 (messages, alignment 16 is allowed)."""
    with pytest.raises(InvalidArgumentError, match=r"^max_eviction_batch must be > 0, got 0$"):
        EmbeddingCache(4 * ALIGN, max_eviction_batch=0)
    with pytest.raises(InvalidTypeError, match=r"^io_workers must be an int, got 'x'$"):
        EmbeddingCache(4 * ALIGN, io_workers="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=r"^store must implement GlobalStore, got object$"):
        EmbeddingCache(4 * ALIGN, store=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"^alignment must be >= 16"):
        EmbeddingCache(4 * ALIGN, alignment=8)
    cache = EmbeddingCache(4 * ALIGN, alignment=16, pin_memory=False)
    assert cache.capacity == 4 * ALIGN
    cache.close()


def test_close_closes_only_a_store_the_cache_created() -> None:
    """Kills cache __init____mutmut_52/53/55 (store ownership and the default store): a given
    store is left open; with none there is no global tier (nothing to close, nothing asked)."""
    store = FaultInjectingStore()
    cache = EmbeddingCache(4 * ALIGN, store=store, pin_memory=False)
    cache.close()
    store.put_object("k", b"x")  # still open
    assert store.exists(["k"]) == [True]
    store.close()
    own = EmbeddingCache(4 * ALIGN, pin_memory=False)
    assert own.store is None
    with own.request("r") as request:
        assert request.lookup([Item("k", (1,), torch.uint8)])[0].status is Status.MISS
        assert request.insert(["k"], [torch.ones(1, dtype=torch.uint8)]) == [True]
        assert request.publish(["k"]) == [False]
    assert own.stats().loads_started == own.stats().publishes_started == 0
    own.close()


def test_request_close_under_a_lock_names_the_wake_up() -> None:
    """Kills cache _signal__mutmut_1/2/3 (what the LockOrderError says is being done)."""
    if not lock_checking_enabled():
        pytest.skip("needs EMBCACHE_LOCK_CHECK=1")
    cache = EmbeddingCache(4 * ALIGN, pin_memory=False)
    try:
        request, waiter = cache.request("r"), cache.request("w")
        item = Item("k", (ALIGN // 4,), torch.float32)
        request.lookup([item], prefetch=False, reserve_misses=True)
        waiter.lookup([item], prefetch=False)  # waits on r's reservation: r's close wakes it
        outer = HierarchyLock(0, "test outer lock")
        with outer, pytest.raises(LockOrderError, match=r"^waking requests while holding"):
            request.close()
        cache.check_invariants()
        waiter.close()
    finally:
        cache.close()


# ------------------------------------------------------------------ second round (final run)
def test_init_event_carries_the_whole_configuration() -> None:
    """Kills cache __init____mutmut_2 (default batch) and __mutmut_80/81/86/87 (Init fields)."""
    trace: list[dict[str, object]] = []
    cache = EmbeddingCache(4 * ALIGN, pin_memory=False, trace=trace)
    cache.close()
    init = [e for e in trace if e["action"] == "Init"]
    if not init:
        pytest.skip("this version of the cache emits no Init event")
    assert {k: v for k, v in init[0].items() if k != "seq"} == {
        "action": "Init",
        "request": None,
        "key": None,
        "outcome": None,
        "capacity": 4 * ALIGN,
        "alignment": ALIGN,
        "max_eviction_batch": 100,
        "enable_eviction": True,
    }


def test_invariants_hold_while_a_publish_is_in_flight() -> None:
    """Kills cache _publish__mutmut_14 (publishing flag not set) and
    _check_invariants_locked__mutmut_65 (the NoUseAfterFree check inverted)."""
    store = FaultInjectingStore()
    store.inject("k", Fault.HOLD)
    cache = EmbeddingCache(8 * ALIGN, store=store, pin_memory=False)
    try:
        with cache.request("r") as request:
            assert request.insert(["k"], [torch.arange(64, dtype=torch.float32)]) == [True]
            wait_until(lambda: store.calls["put_from"] == 1, "the publish to start")
            cache.check_invariants()  # READY, pinned by r and by the publish
            assert cache.stats().publishes_started == 1
            store.release_holds()
            wait_until(lambda: cache.stats().publishes_ok == 1, "the publish to end")
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


def test_last_release_of_a_tainted_entry_clears_its_flags() -> None:
    """Kills cache _drop_pin__mutmut_15 (tainted/doomed left None instead of False)."""
    trace: list[dict[str, object]] = []
    cache = EmbeddingCache(8 * ALIGN, store=MiscountingStore(), pin_memory=False, trace=trace)
    try:
        with cache.request("r") as request:
            assert request.insert(["k"], [torch.arange(64, dtype=torch.float32)]) == [True]
            wait_until(lambda: cache.stats().publishes_unknown == 1, "the publish to end")
        release = [e for e in trace if e["action"] == "Release"][-1]
        assert release["state"] == "QUARANTINED"
        assert release["tainted"] is False and release["doomed"] is False
    finally:
        cache.close()


def test_a_closed_event_loop_does_not_stop_other_wake_ups() -> None:
    """Kills cache _signal__mutmut_9 (the RuntimeError of a closed loop escapes the wake loop)."""
    cache, store = held_cache(["k"])
    item = Item("k", (64,), torch.float32)
    try:
        a, b = cache.request("a"), cache.request("b")
        a.lookup([item])
        b.lookup([item])

        async def cancelled() -> None:  # leaves a's future behind on a loop that then closes
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(a.wait_async(), 0.01)

        asyncio.run(cancelled())
        assert cache.sizes()["async_waiters"] == 1  # the premise: a's waiter on a closed loop

        async def wait_b() -> bool:
            task = asyncio.ensure_future(b.wait_async(timeout=5))
            while cache.sizes()["async_waiters"] < 2:  # a's left on its loop, and b's
                await asyncio.sleep(0.001)
            store.release_holds()
            return await task

        assert asyncio.run(wait_b()) is True
        a.close()
        b.close()
        cache.check_invariants()
    finally:
        store.release_holds()
        cache.close()


def test_transition_table_agrees_with_how_the_controller_uses_it() -> None:
    """Kills TRANSITIONS retarget mutants that the controller never reads back.

    For some steps cache.py calls ``transition`` only as a guard and keeps the state (or, for
    BeginLoad, creates the entry LOADING); for the steps that free a range it frees the entry,
    which sets ABSENT. The table has to say the same, or the model, the TLA+ spec and the
    controller disagree silently.
    """
    from embcache.core.lifecycle import TRANSITIONS
    from embcache.driver.cache import Entry

    assert Entry("k", (1,), "dtype", 0, ALIGN).state is LOADING  # default (compiled: no signature)
    guard_only = {Step.LOOKUP_HIT, Step.LOOKUP_JOIN, Step.RELEASE_WAIT, Step.REMOVE_BUSY}
    guard_only |= {Step.PUBLISH}
    freeing = {Step.EVICT, Step.REMOVE_IDLE, Step.FENCE, Step.RELEASE_LAST_DOOMED}
    freeing |= {Step.END_LOAD_DOOMED, Step.END_LOAD_FAILED}
    seen = set()
    for (state, step), target in TRANSITIONS.items():
        seen.add(step)
        if step in guard_only:
            assert target is state, (state, step, target)
        elif step is Step.BEGIN_LOAD:
            assert (state, target) == (ABSENT, LOADING)
        elif step in freeing:
            assert target is ABSENT, (state, step, target)
    assert guard_only | freeing | {Step.BEGIN_LOAD} <= seen


class ShortExistsStore(FaultInjectingStore):
    """A store whose ``exists`` answers one key too few."""

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return super().exists(keys)[:-1]


class ShortReadStore(FaultInjectingStore):
    """A store whose ``get_into`` answers one key too few."""

    def get_into(self, keys, offsets, sizes):  # type: ignore[no-untyped-def]
        return super().get_into(keys, offsets, sizes)[:-1]


def test_a_store_answering_too_few_exists_is_a_store_error() -> None:
    """Kills cache _lookup_items__mutmut_28/31/33 (zip without strict over exists())."""
    store = ShortExistsStore()
    cache = EmbeddingCache(8 * ALIGN, store=store, pin_memory=False)
    try:
        for key in ("a", "b"):
            store.put_object(key, torch.arange(64, dtype=torch.float32).numpy().tobytes())
        with cache.request("r") as request:
            statuses = request.lookup([Item(k, (64,), torch.float32) for k in ("a", "b")])
            assert [s.reason for s in statuses] == [Reason.STORE_ERROR, Reason.STORE_ERROR]
        cache.check_invariants()
    finally:
        cache.close()


def test_a_store_answering_too_few_reads_ends_the_load_unknown() -> None:
    """Kills cache _run_loads__mutmut_22/25/26 (zip without strict over get_into())."""
    store = ShortReadStore()
    cache = EmbeddingCache(8 * ALIGN, store=store, pin_memory=False)
    try:
        store.put_object("a", torch.arange(64, dtype=torch.float32).numpy().tobytes())
        with cache.request("r") as request:
            assert request.lookup([Item("a", (64,), torch.float32)])[0].status.name == "LOADING"
            assert request.wait(timeout=10)
            assert request.fallback_reasons() == [Reason.LOAD_UNKNOWN]
        assert cache.entry_state("a") is QUARANTINED
        cache.check_invariants()
    finally:
        cache.close()


# ------------------------------------------------------------------ one body per action
# The hot actions (``request_bodies.lookup_all``, ``request_bodies.release_all``) have one
# body, traced or not; each test runs both ways, so a bug planted in that body fails both.
# Checked by planting (then reverting): a release that drops a pin as the last while another
# holder remains (``len(holders) > 2``), and a lookup that skips the ``doomed`` branch (a doomed
# entry hit).
def one_body_cache(traced: bool) -> EmbeddingCache:
    return EmbeddingCache(ALIGN, pin_memory=False, trace=TraceLog() if traced else None)


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_pins_are_counted_exactly_traced_or_not(traced: bool) -> None:
    cache = one_body_cache(traced)
    a = Item("a", (ALIGN // 4,), torch.float32)
    with cache.request("setup") as setup:
        assert setup.insert(["a"], [torch.ones(ALIGN // 4)], publish=False) == [True]
    r1, r2 = cache.request("r1"), cache.request("r2")
    assert [s.status for s in r1.lookup([a, a], prefetch=False)] == [Status.HIT, Status.HIT]
    assert [s.status for s in r2.lookup([a], prefetch=False)] == [Status.HIT]
    snap = cache.snapshot()
    assert snap.entries["a"].pins == 2 and snap.eviction_order == []
    r1.close()  # r2 still pins "a": not evictable, not replaced by an insert
    snap = cache.snapshot()
    assert snap.entries["a"].pins == 1 and snap.eviction_order == []
    assert cache.insert(["b"], [torch.zeros(ALIGN // 4)], publish=False) == [False]
    assert cache.entry_state("a") is READY and cache.snapshot().evictable_bytes == 0
    cache.check_invariants()
    r2.close()
    snap = cache.snapshot()
    assert snap.entries["a"].pins == 0 and snap.eviction_order == ["a"]
    assert snap.pinned_since == {} and snap.evictable_bytes == ALIGN
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_a_doomed_entry_takes_no_pin_traced_or_not(traced: bool) -> None:
    cache = one_body_cache(traced)
    a = Item("a", (ALIGN // 4,), torch.float32)
    holder = cache.request("holder")
    assert holder.insert(["a"], [torch.ones(ALIGN // 4)], publish=False) == [True]
    assert cache.remove("a") is True  # pinned by its inserter: doomed
    with cache.request("late") as late:
        [status] = late.lookup([a], prefetch=False)
        assert (status.status, status.reason) == (Status.MISS, Reason.BUSY)
        assert late.embeddings() == [None]
        assert cache.snapshot().entries["a"].pins == 1  # the holder's only
        cache.check_invariants()
    holder.close()  # the last pin of a doomed entry frees it
    assert cache.entry_state("a") is ABSENT and cache.stats().allocated_bytes == 0
    cache.check_invariants()
    cache.close()
