"""Issue 15 in the cache: a policy shapes the eviction order and may refuse a BeginLoad that
would evict; a refusal evicts nothing, is traced, counted and reported as a fallback reason."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from embcache import EmbeddingCache, Item
from embcache.core.policy import make_policy
from embcache.core.sketch import FrequencySketch
from embcache.driver.trace import TraceLog
from embcache.errors import InvalidArgumentError, InvalidTypeError
from tests.support.helpers import payload

UNIT = 256


def unit_item(key: str) -> Item:
    return Item(key, (UNIT // 4,), torch.float32)


def warm(cache: EmbeddingCache, keys: list[str], times: int) -> None:
    """Look each key up ``times`` times (hits once present)."""
    for n in range(times):
        with cache.request(f"warm-{n}") as request:
            request.lookup([unit_item(k) for k in keys], prefetch=False)


def test_tinylfu_refuses_an_insert_that_would_evict_hotter_entries(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    trace = TraceLog()
    policy = make_policy("tinylfu", min_entries=1, shift_drop=0.0)
    cache = make_cache(2 * UNIT, alignment=UNIT, policy=policy, trace=trace)
    for key in ("a", "b"):
        with cache.request(f"fill-{key}") as request:
            request.insert([key], [payload((UNIT // 4,), torch.float32, 0)], publish=False)
    warm(cache, ["a", "b"], 3)  # a and b: looked up often
    before = cache.stats()
    with cache.request("cold") as request:
        [status] = request.lookup([unit_item("cold")], prefetch=False, reserve_misses=True)
        assert status.reason is not None and status.reason.value == "not_admitted"
        assert [r.value for r in request.fallback_reasons() if r] == ["not_admitted"]
        assert request.insert(["cold"], [payload((UNIT // 4,), torch.float32, 1)]) == [False]
    after = cache.stats()
    assert after.evictions == before.evictions, "a refused BeginLoad evicted something"
    assert after.entries == 2 and after.admissions_refused == 2
    refusals = [e for e in trace.events if e["action"] == "BeginLoad" and e["outcome"] != "OK"]
    assert [(e["key"], e["outcome"]) for e in refusals] == [
        ("cold", "NOT_ADMITTED"),
        ("cold", "NOT_ADMITTED"),
    ]
    cache.check_invariants()


def apart_from(key: str, width: int) -> str:
    """A victim's name whose sketch counters, at ``width`` and every wider sketch, are not all
    ``key``'s: under some hash seeds (PYTHONHASHSEED) two names share all four, and the sketch
    then rightly estimates them alike (a count-min sketch errs only upward)."""
    probe = FrequencySketch(width, 15)
    probe.add(key)
    for n in range(64):
        name = f"victim-{n}"
        if probe.estimate(name) == 0:
            return name
    raise AssertionError(f"no name apart from {key!r} in 64 tries")


def test_tinylfu_admits_a_key_looked_up_more_often_than_its_victims(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    policy = make_policy("tinylfu", min_entries=1, shift_drop=0.0)
    cache = make_cache(UNIT, alignment=UNIT, policy=policy)
    victim = apart_from("hot", policy.sketch.width)  # the narrowest the sketch will be
    with cache.request("fill") as request:
        request.insert([victim], [payload((UNIT // 4,), torch.float32, 0)], publish=False)
    warm(cache, ["hot"], 4)  # misses, but counted
    assert policy.estimate("hot") == 4 and policy.estimate(victim) == 0
    with cache.request("hot") as request:
        [status] = request.lookup([unit_item("hot")], prefetch=False, reserve_misses=True)
        assert status.status.name == "RESERVED"
    assert cache.stats().evictions == 1 and cache.stats().admissions_refused == 0


def test_lru_never_refuses(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache(UNIT, alignment=UNIT, policy="lru")
    for n in range(5):
        with cache.request(f"r{n}") as request:
            tensor = payload((UNIT // 4,), torch.float32, n)
            assert request.insert([f"k{n}"], [tensor], publish=False) == [True]
    assert cache.stats().admissions_refused == 0 and cache.stats().evictions == 4


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        ("mru", InvalidArgumentError, "unknown policy 'mru'"),
        (3, InvalidTypeError, "policy must be a name"),
    ],
)
def test_a_bad_policy_is_refused(
    make_cache: Callable[..., EmbeddingCache], policy: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make_cache(UNIT, alignment=UNIT, policy=policy)


# No halving or shift within the test, and the filter expert answers (its shadow's hits x 2
# stay above the LRU shadow's): what admission does is the filter's rule alone.
FILTER_ONLY = {"min_entries": 1, "sample_factor": 100, "shift_drop": 0, "favour": 2.0}


def cheap_dear_then_new(cache: EmbeddingCache, work: dict[str, float] | None) -> str | None:
    """A pool of two units holding ``cheap`` and ``dear`` (inserted with ``work``'s seconds,
    or none), each looked up 5 times, ``cheap`` the older; then ``new`` looked up twice and a
    third time reserving its miss, which must evict ``cheap``. The reservation's fallback
    reason (None: admitted)."""
    for key in ("cheap", "dear"):
        with cache.request(f"fill-{key}") as request:
            seconds = None if work is None else [work[key]]
            tensor = payload((UNIT // 4,), torch.float32, 0)
            assert request.insert([key], [tensor], publish=False, work=seconds) == [True]
    warm(cache, ["cheap", "dear"], 5)
    warm(cache, ["new"], 2)
    with cache.request("new") as request:
        [status] = request.lookup([unit_item("new")], prefetch=False, reserve_misses=True)
    cache.check_invariants()
    return None if status.reason is None else status.reason.value


@pytest.mark.parametrize(
    ("policy", "work", "reason"),
    [
        ("adaptive-work", {"cheap": 0.001, "dear": 1.0}, None),  # 3 x mean > 5 x cheap's
        ("adaptive-work", None, "not_admitted"),  # no work told: adaptive's answer (3 < 5)
        ("adaptive", {"cheap": 0.001, "dear": 1.0}, "not_admitted"),  # work unused
    ],
)
def test_adaptive_work_admits_by_the_work_the_inserts_measured(
    make_cache: Callable[..., EmbeddingCache], policy: str, work: dict[str, float] | None,
    reason: str | None,
) -> None:  # fmt: skip
    """Issue 41, point 2, through the real cache: ``new`` (3 lookups, never encoded here: the
    mean of the measured seconds per byte) is worth more than ``cheap`` (5 lookups, 1 ms) and
    displaces it; without work, or under ``adaptive``, the counts alone refuse it."""
    cache = make_cache(2 * UNIT, alignment=UNIT, policy=make_policy(policy, **FILTER_ONLY))
    assert cheap_dear_then_new(cache, work) == reason
    assert cache.entry_state("cheap").name == ("ABSENT" if reason is None else "READY")


@pytest.mark.parametrize(("told", "reason"), [(True, None), (False, "not_admitted")])
def test_adaptive_work_remembers_the_work_of_an_output_it_refused(
    make_cache: Callable[..., EmbeddingCache], told: bool, reason: str | None
) -> None:
    """``new`` is refused (3 lookups at the mean, 10 ms, against ``cheap``'s 5 at 10 ms); its
    request still inserts its encoder output, telling its work (20 ms): not cached, it is
    remembered among the ghosts, so its next lookup (4 lookups at 20 ms) displaces ``cheap``
    (6 at 10 ms by then). Not told (``work`` None), it stays at the mean and is refused
    again; so it would be at the mean told (13.3 ms: 4 x 13.3 < 6 x 10) if the ghosts were
    not consulted."""
    cache = make_cache(2 * UNIT, alignment=UNIT, policy=make_policy("adaptive-work", **FILTER_ONLY))
    assert cheap_dear_then_new(cache, {"cheap": 0.01, "dear": 0.01}) == "not_admitted"
    with cache.request("insert-new") as request:
        tensor = payload((UNIT // 4,), torch.float32, 2)
        work = [0.02] if told else None
        assert request.insert(["new"], [tensor], publish=False, work=work) == [False]
    warm(cache, ["cheap", "dear"], 1)  # (the filter's shadow hits: the filter still answers)
    with cache.request("new-again") as request:
        [status] = request.lookup([unit_item("new")], prefetch=False, reserve_misses=True)
    assert (None if status.reason is None else status.reason.value) == reason
    cache.check_invariants()


def test_the_admission_test_catches_an_insert_that_drops_the_work(
    make_cache: Callable[..., EmbeddingCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: ``Request.insert`` checks the work it is given and passes none on (patched in
    the driver, which both builds run as Python): ``new`` is refused."""
    import embcache.driver.request as driver_request

    monkeypatch.setattr(driver_request, "checked_work", lambda work, items: None)
    cache = make_cache(2 * UNIT, alignment=UNIT, policy=make_policy("adaptive-work", **FILTER_ONLY))
    assert cheap_dear_then_new(cache, {"cheap": 0.001, "dear": 1.0}) == "not_admitted"


@pytest.mark.parametrize(
    ("work", "error", "named"),
    [
        ([-0.5], InvalidArgumentError, "finite seconds >= 0, got -0.5"),
        ([float("nan")], InvalidArgumentError, "got nan"),
        ([float("-inf")], InvalidArgumentError, "got -inf"),
        ([1.0, 1.0], InvalidArgumentError, "2 values for 1 items"),
        (["fast"], InvalidTypeError, "got str 'fast'"),
        (0.5, InvalidTypeError, "got float"),
    ],
)
def test_bad_work_is_refused_and_changes_nothing(
    make_cache: Callable[..., EmbeddingCache], work: object, error: type, named: str
) -> None:
    """A bad ``work`` to ``Request.insert`` (into a reservation) or ``EmbeddingCache.insert``
    raises a specific error before anything moves: the reservation is still held and still
    fillable, nothing is inserted, the counters and the policy's notes are as before."""
    policy = make_policy("adaptive-work", min_entries=1)
    cache = make_cache(4 * UNIT, alignment=UNIT, policy=policy)
    tensor = payload((UNIT // 4,), torch.float32, 0)
    with cache.request("r") as request:
        [status] = request.lookup([unit_item("k")], prefetch=False, reserve_misses=True)
        assert status.status.name == "RESERVED"
        before = (cache.stats(), policy.footprint())  # type: ignore[attr-defined]
        with pytest.raises(error, match=re.escape(named)):
            request.insert(["k"], [tensor], publish=False, work=work)  # type: ignore[arg-type]
        with pytest.raises(error, match=re.escape(named)):
            cache.insert(["other"], [tensor], publish=False, work=work)  # type: ignore[arg-type]
        assert (cache.stats(), policy.footprint()) == before  # type: ignore[attr-defined]
        assert cache.entry_state("k").name == "LOADING"
        assert cache.entry_state("other").name == "ABSENT"
        assert request.insert(["k"], [tensor], publish=False, work=[0.25]) == [True]
    assert policy.work_per_byte("k") == 0.25 / UNIT  # type: ignore[attr-defined]
    cache.check_invariants()


class RowsEncoder:
    """Input ``n`` encodes to ``n`` rows of 64 float32 (one unit a row); each call sleeps
    ``SLEEP`` seconds, whatever its rows."""

    SLEEP = 0.05
    device = torch.device("cpu")

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        time.sleep(self.SLEEP)
        return [torch.full((n, UNIT // 4), float(n)) for n in inputs]


def test_the_pipeline_passes_each_outputs_share_of_the_encoder_time() -> None:
    """The encode pipeline times its encoder call (``encoder_seconds``) and gives each fresh
    output its share by rows: one call encoding 1 and 3 rows gives the first a quarter of the
    call's seconds, the second three quarters, both the same seconds per byte."""
    from embcache.pipeline import EncodePipeline

    policy: Any = make_policy("adaptive-work")
    with EmbeddingCache(16 * UNIT, alignment=UNIT, pin_memory=False, policy=policy) as cache:
        pipeline = EncodePipeline(cache, RowsEncoder())
        items = [Item(f"rows{n}", (n, UNIT // 4), torch.float32) for n in (1, 3)]
        pipeline.encode("r", items, [1, 3])
        seconds = pipeline.stats().encoder_seconds
        assert seconds >= RowsEncoder.SLEEP
        one, three = policy.work_per_byte("rows1"), policy.work_per_byte("rows3")
        assert one * UNIT == pytest.approx(seconds / 4) and three == pytest.approx(one)
        assert (policy.footprint().work, policy.footprint().work_ghosts) == (2, 0)


@pytest.mark.parametrize(
    ("policy", "uses"), [("lru", False), ("adaptive", False), ("adaptive-work", True)]
)
def test_the_pipeline_passes_work_only_to_a_cache_whose_policy_uses_it(
    monkeypatch: pytest.MonkeyPatch, policy: str, uses: bool
) -> None:
    """``EmbeddingCache.uses_work`` says whether the policy admits by work; the pipeline then
    shares its encoder time among the outputs, else passes none (no list built per insert)."""
    from embcache import Request
    from embcache.pipeline import EncodePipeline

    passed: list[object] = []
    insert = Request.insert

    def spy(self: Request, keys: Any, tensors: Any, **kwargs: Any) -> list[bool]:
        passed.append(kwargs.get("work"))
        return insert(self, keys, tensors, **kwargs)

    monkeypatch.setattr(Request, "insert", spy)
    with EmbeddingCache(16 * UNIT, alignment=UNIT, pin_memory=False, policy=policy) as cache:
        assert cache.uses_work is uses
        EncodePipeline(cache, RowsEncoder()).encode(
            "r", [Item("a", (2, UNIT // 4), torch.float32)], [2]
        )
    [work] = passed
    assert (work is not None) is uses
