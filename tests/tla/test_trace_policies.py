"""Trace validation of admission refusals and of the eviction order (issues 15 and 16).

Hand-written traces in the format of ``embcache.driver.trace``: a refused ``BeginLoad`` (outcome
``NOT_ADMITTED``) is accepted, and rejected when evictions come with it; a Lookup never misses
for ``not_admitted``; the release order of a closing request is whatever the trace logs (the
code now releases in lookup order, formerly in key-name order); an entry that becomes
evictable enters the eviction order at its tail (LRU) unless the event logs its position.
The TLC runs are marked ``tla``; the conversion tests need neither Java nor TLC.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.tla.tla_modules import load_trace

UNIT = 256
WORK_S = {"a": 0.5, "b": 0.5, "c": 0.25}  # encoder seconds each insert reports (adaptive-work)


trace_mod = load_trace()


class Trace:
    """Builds a trace event by event, numbering them as the code's TraceLog does."""

    def __init__(self, units: int, batch: int = 2) -> None:
        self.events: list[dict[str, Any]] = []
        self.add({
            "action": "Init", "request": None, "key": None, "outcome": None,
            "capacity": units * UNIT, "alignment": UNIT, "max_eviction_batch": batch,
            "enable_eviction": True,
        })  # fmt: skip

    def add(self, event: dict[str, Any]) -> dict[str, Any]:
        self.events.append({"seq": len(self.events) + 1, **event})
        return self.events[-1]

    def act(
        self, action: str, request: str | None = None, key: str | None = None,
        outcome: str | None = None, **fields: Any,
    ) -> dict[str, Any]:  # fmt: skip
        return self.add(
            {"action": action, "request": request, "key": key, "outcome": outcome, **fields}
        )

    def entry(
        self, action: str, request: str | None, key: str, state: str, units: int, at: int,
        outcome: str | None = None, holders: tuple[str, ...] = (),
        waiters: tuple[str, ...] = (),
    ) -> dict[str, Any]:  # fmt: skip
        """An event that carries the entry's post-state."""
        return self.act(
            action, request, key, outcome, size=units * UNIT, offset=at * UNIT, state=state,
            holders=sorted(holders), waiters=sorted(waiters), doomed=False, tainted=False,
        )  # fmt: skip

    def load(self, request: str, key: str, units: int, at: int) -> None:
        """A reservation filled by the request: BeginLoad, then EndLoad(OK) pins it."""
        self.entry("BeginLoad", request, key, "LOADING", units, at, "OK", waiters=(request,))
        self.entry("EndLoad", None, key, "READY", units, at, "OK", holders=(request,))

    def miss(self, request: str, key: str, reason: str = "not_found") -> dict[str, Any]:
        return self.act("Lookup", request, key, "MISS", reason=reason)

    def refuse(self, request: str, key: str, nbytes: int) -> dict[str, Any]:
        """A BeginLoad refused by admission, logged like a failed one."""
        return self.act("BeginLoad", request, key, "NOT_ADMITTED", size=nbytes)


def two_entries_released(first: str, second: str, positions: tuple[int, ...] = ()) -> Trace:
    """r1 fills a pool of two units with b then a, and releases `first`, then `second`
    (each entering the eviction order at the logged position, else at the tail)."""
    trace = Trace(2)
    trace.act("OpenRequest", "r1")
    trace.load("r1", "b", 1, 0)
    trace.load("r1", "a", 1, 1)
    offsets = {"b": 0, "a": 1}
    for number, key in enumerate((first, second)):
        release = trace.entry("Release", "r1", key, "READY", 1, offsets[key])
        if positions:
            release["position"] = positions[number]
    trace.act("CloseRequest", "r1")
    return trace


def evict_for_c(trace: Trace, victim: str) -> Trace:
    """r2 loads c (one unit) into the full pool, evicting `victim`."""
    at = {"b": 0, "a": 1}[victim]
    trace.act("OpenRequest", "r2")
    trace.entry("Evict", None, victim, "ABSENT", 1, at)
    trace.entry("BeginLoad", "r2", "c", "LOADING", 1, at, "OK", waiters=("r2",))
    return trace


def refusal_trace(evict_first: bool = False) -> Trace:
    """Refusals with and without room; the refused items are never cached, nothing moves."""
    trace = Trace(3)
    trace.act("OpenRequest", "r1")
    trace.miss("r1", "a")
    trace.load("r1", "a", 1, 0)
    trace.miss("r1", "x")
    trace.refuse("r1", "x", 300)  # a free run of two units fits: refused all the same
    trace.miss("r1", "b")
    trace.load("r1", "b", 2, 1)
    trace.entry("Release", "r1", "a", "READY", 1, 0)
    trace.entry("Release", "r1", "b", "READY", 2, 1)
    trace.act("CloseRequest", "r1")
    trace.act("OpenRequest", "r2")
    trace.miss("r2", "c")
    if evict_first:  # the bug: the victims are evicted, then admission refuses
        trace.entry("Evict", None, "a", "ABSENT", 1, 0)
    trace.refuse("r2", "c", UNIT)  # the pool is full: a load would evict a
    trace.entry("Lookup", "r2", "a", "READY", 1, 0, "HIT", holders=("r2",))
    trace.miss("r2", "c")  # not cached: the item fell back
    trace.entry("Release", "r2", "a", "READY", 1, 0)
    trace.act("CloseRequest", "r2")
    return trace


# ------------------------------------------------------------------ conversion (no TLC)


def test_a_refusal_converts_like_a_failed_begin_load_and_keeps_its_evictions() -> None:
    trace = refusal_trace(evict_first=True)
    converted = trace_mod.convert(trace.events, "t")
    refusals = [e for e in converted.events if e["out"] == "NOT_ADMITTED"]
    assert [(e["a"], e["k"], e["n"], e["e"]) for e in refusals] == [
        ("BeginLoad", "x", 2, False),  # 300 bytes ask for two units
        ("BeginLoad", "c", 1, False),
    ]
    assert [e["V"] for e in refusals] == [set(), {"a"}]  # the Evict before it is its victim
    assert "EvictWithoutBeginLoad" not in {e["a"] for e in converted.events}


def test_an_entry_enters_the_order_at_its_logged_position_else_at_the_tail() -> None:
    tail = trace_mod.convert(two_entries_released("b", "a").events, "t")
    assert {e["at"] for e in tail.events} == {-1}
    logged = trace_mod.convert(two_entries_released("b", "a", positions=(0, 1)).events, "t")
    assert [e["at"] for e in logged.events if e["a"] == "Release"] == [0, 1]


def test_release_events_keep_the_order_they_were_logged_in() -> None:
    converted = trace_mod.convert(two_entries_released("b", "a").events, "t")
    assert [e["k"] for e in converted.events if e["a"] == "Release"] == ["b", "a"]


# ------------------------------------------------------------------ TLC


@pytest.mark.tla
@pytest.mark.timeout(300)
def test_refusals_and_release_orders_are_validated() -> None:
    named = {
        "refusals": refusal_trace(),
        "refusal_after_evict": refusal_trace(evict_first=True),
        "release_b_a_evict_b": evict_for_c(two_entries_released("b", "a"), "b"),
        "release_a_b_evict_a": evict_for_c(two_entries_released("a", "b"), "a"),
        "release_b_a_evict_a": evict_for_c(two_entries_released("b", "a"), "a"),
        "position_a_ahead_of_b_evict_a": evict_for_c(
            two_entries_released("b", "a", positions=(0, 0)), "a"
        ),
        "position_a_behind_b_evict_a": evict_for_c(
            two_entries_released("b", "a", positions=(0, 1)), "a"
        ),
    }
    bad_miss = refusal_trace()
    bad_miss.events[2]["reason"] = "not_admitted"  # r1's first lookup of a
    verdicts = {
        v.name: v
        for v in trace_mod.validate(
            traces=[(name, t.events) for name, t in named.items()]
            + [("miss_not_admitted", bad_miss.events)],
            workers=1,
        )
    }
    accepted = {name for name, v in verdicts.items() if v.accepted}
    assert accepted == {
        "refusals", "release_b_a_evict_b", "release_a_b_evict_a", "position_a_ahead_of_b_evict_a",
    }, "\n".join(v.describe() for v in verdicts.values())  # fmt: skip

    refused = verdicts["refusal_after_evict"]  # rejected at the refusal, not before
    assert refused.event is not None and refused.event["outcome"] == "NOT_ADMITTED"
    assert refused.event["key"] == "c" and refused.why == "ActionMatches", refused.describe()

    for name in ("release_b_a_evict_a", "position_a_behind_b_evict_a"):  # b must go first
        wrong_victim = verdicts[name]
        assert wrong_victim.event is not None, wrong_victim.describe()
        assert (wrong_victim.event["action"], wrong_victim.event["key"]) == ("BeginLoad", "c")
        assert wrong_victim.why == "ActionMatches", wrong_victim.describe()

    miss = verdicts["miss_not_admitted"]
    assert miss.seq == 3 and miss.why == "ActionEnabled", miss.describe()


@pytest.mark.tla
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["tinylfu", "adaptive", "adaptive-work"])
def test_a_trace_of_the_cache_with_refusals_and_admissions_is_accepted(policy: str) -> None:
    import torch

    from embcache import EmbeddingCache, Item
    from embcache.driver.trace import TraceLog

    def item(key: str) -> Item:
        return Item(key, (UNIT // 4,), torch.float32)

    def insert(key: str) -> bool:
        with cache.request(f"insert-{key}") as r:
            r.lookup([item(key)])
            tensor = torch.zeros(item(key).shape)
            [cached] = r.insert([key], [tensor], publish=False, work=[WORK_S[key]])
            return bool(cached)

    log = TraceLog()
    cache = EmbeddingCache(
        2 * UNIT, alignment=UNIT, max_eviction_batch=2, pin_memory=False, io_workers=1,
        trace=log, policy=policy,
    )  # fmt: skip
    try:
        assert insert("a") and insert("b")
        for _ in range(5):  # a and b become popular
            for key in ("a", "b"):
                with cache.request("hit") as r:
                    r.lookup([item(key)])
        attempts = [insert("c") for _ in range(20)]  # refused until c is counted often enough
    finally:
        cache.close()
    assert attempts[0] is False and True in attempts, attempts
    outcomes = [e["outcome"] for e in log.events if e["action"] == "BeginLoad"]
    assert "NOT_ADMITTED" in outcomes and any(e["action"] == "Evict" for e in log.events)
    [verdict] = trace_mod.validate(traces=[(policy, list(log.events))], workers=1)
    assert verdict.accepted, verdict.describe()
