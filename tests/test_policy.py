"""Eviction orders and admission policies: each against its reference model, LRU against the
seed's OrderedDict, the TinyLFU filter's aging on a drifting mix, the frequency sketch, memory
that stays at its bound however many keys pass, bad knobs, and the benchmark's simulation
against the real cache."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embcache.core.cache_core import CacheCore
from embcache.core.outcomes import Status, TransferOutcome
from embcache.core.policy import (
    DEPTH,
    AdaptivePolicy,
    FrequencySketch,
    LruPolicy,
    Policy,
    TinyLfuPolicy,
    make_policy,
)
from embcache.errors import InvalidArgumentError, InvalidTypeError
from models.policy import MODELS

ROOT = Path(__file__).resolve().parents[1]

KEYS = st.sampled_from("abcdefg")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), KEYS),
        st.tuples(st.just("add"), KEYS),
        st.tuples(st.just("discard"), KEYS),
        st.tuples(st.just("forget"), KEYS),
        st.tuples(st.just("admit"), KEYS, st.integers(1, 4), st.integers(1, 9)),
    ),
    max_size=200,
)
SMALL_KNOBS = st.fixed_dictionaries(
    {
        "sample_factor": st.integers(1, 8),
        "min_entries": st.integers(1, 4),
        "max_count": st.integers(1, 5),
        "shift_block": st.integers(1, 4),
        "shift_drop": st.sampled_from([0.0, 0.5, 0.6, 0.9]),
    }
)


def drive(name: str, knobs: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    """Run ``ops`` on the policy and on its model; orders, answers and counts must agree."""
    policy: Any = make_policy(name, **knobs)
    model: Any = MODELS[name](**knobs)
    order, model_order = policy.order(), model.order()
    for op in ops:
        kind, key = op[0], op[1]
        if kind == "record":
            policy.record(key)
            model.record(key)
        elif kind in ("add", "discard"):
            getattr(order, kind)(key)
            getattr(model_order, kind)(key)
        elif kind == "forget":  # the core frees: out of the order, then forgotten
            order.discard(key)
            policy.forget(key)
            model_order.discard(key)
            model.forget(key)
        else:
            victims, nbytes = list(model_order)[: op[2]], op[3] << 20
            assert policy.admit(key, nbytes, victims) == model.admit(key, nbytes, victims), op
        assert list(order) == list(model_order), op
        assert len(order) == len(model_order)
        assert all((k in order) == (k in model_order) for k in "abcdefg")
        if name != "lru":
            assert {k: policy.estimate(k) for k in "abcdefg"} == {
                k: model.estimate(k) for k in "abcdefg"
            }, op
        if name == "adaptive":
            assert policy.window == model.window, op


@given(OPS)
def test_lru_matches_its_model(ops: list[tuple[Any, ...]]) -> None:
    drive("lru", {}, ops)


@given(SMALL_KNOBS, OPS)
def test_tinylfu_matches_its_model(knobs: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    drive("tinylfu", knobs, ops)


@given(
    SMALL_KNOBS,
    st.fixed_dictionaries(
        {
            "window": st.sampled_from([0.0, 0.3, 0.5, 1.0]),
            "step": st.sampled_from([0.0, 0.25, 0.5]),
            "horizon": st.integers(1, 3),
        }
    ),
    OPS,
)
def test_adaptive_matches_its_model(
    knobs: dict[str, Any], window: dict[str, Any], ops: list[tuple[Any, ...]]
) -> None:
    drive("adaptive", {**knobs, **window, "low": 0.0, "high": 1.0}, ops)


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("record"), KEYS),
            st.tuples(st.just("admit"), KEYS, st.just(1), st.integers(1, 9)),
        ),
        max_size=100,
    )
)
def test_adaptive_matches_its_model_past_its_ghost_bound(ops: list[tuple[Any, ...]]) -> None:
    """One resident entry, looked up often: most admissions are refused, and the ghosts
    (bounded at 2 x (1 + 1) x 1) overflow, so the oldest are dropped, as the model drops them."""
    knobs = {"min_entries": 1, "shift_drop": 0, "sample_factor": 8, "window": 0.3, "step": 0.25}
    drive(
        "adaptive", {**knobs, "low": 0.0, "high": 1.0}, [("add", "a"), *[("record", "a")] * 3, *ops]
    )


def test_adaptive_admits_a_window_share_of_the_refused_bytes() -> None:
    """The filter refuses a never-seen key against a counted victim; with ``window`` 0.5 every
    second refusal of equal size is admitted anyway, with 0 none is, with 1 all are (LRU)."""
    answers = {}
    for window in (0.0, 0.5, 1.0):
        policy = AdaptivePolicy(window=window, low=0, high=1, step=0, shift_drop=0)
        policy.record("hot")
        answers[window] = [policy.admit(f"new{n}", 100, ["hot"]) for n in range(6)]
    assert answers[0.0] == [False] * 6
    assert answers[0.5] == [False, True] * 3
    assert answers[1.0] == [True] * 6


def adaptive_period(policy: AdaptivePolicy, comes_back: str) -> None:
    """One period (16 lookups): two refusals and two window admissions against the counted
    victim ``hot``; then ``comes_back`` (``refused``: the refused keys, ``evicted``: the
    victims) is looked up again within the horizon."""
    for n in range(4):
        policy.admit(f"new{n}", 100, [f"victim{n}", "hot"])  # refused, admitted, ...
    back = ["new0", "new2"] if comes_back == "refused" else ["victim1", "victim3"]
    for key in [*back, *["hot"] * (16 - len(back))]:
        policy.record(key)


def test_adaptive_window_moves_toward_the_side_that_regrets_less() -> None:
    """Refused candidates that come back move the window up a step (the filter was wrong);
    victims of window admissions that come back move it down (the window was wrong)."""
    policy = AdaptivePolicy(window=0.5, step=0.125, shift_drop=0, sample_factor=100)
    policy.order()
    policy.record("hot")
    for _ in range(15):  # the first period ends with no decision: no move
        policy.record("hot")
    assert (policy.window, policy.moves) == (0.5, 0)
    adaptive_period(policy, "refused")
    assert (policy.window, policy.moves) == (0.625, 1)
    adaptive_period(policy, "evicted")
    assert (policy.window, policy.moves) == (0.5, 2)
    for _ in range(8):  # bounded by high
        adaptive_period(policy, "refused")
    assert policy.window == 0.98


def test_adaptive_regret_expires_after_its_horizon() -> None:
    """A key refused at lookup 1 regrets only when looked up again by lookup 1 + 16 (the
    horizon: 1 x 16 lookups). Looked up at 17 the window moves up at the end of that period;
    at 18 it does not move (the period's other refusal never comes back)."""
    for back_at, window in ((17, 0.375), (18, 0.25)):
        policy = AdaptivePolicy(window=0.25, step=0.125, shift_drop=0, sample_factor=100)
        policy.order()
        policy.record("hot")
        assert not policy.admit("late", 100, ["hot"])
        for n in range(2, 33):
            policy.record("late" if n == back_at else "hot")
            if n == 20:
                assert not policy.admit("other", 100, ["hot"])
        assert (policy.window, policy.moves) == (window, window != 0.25), back_at


@given(st.lists(st.tuples(st.booleans(), KEYS), max_size=100))
def test_lru_order_is_the_seeds_ordered_dict(ops: list[tuple[bool, str]]) -> None:
    """add = the seed's ``_make_evictable`` (a key enters at the tail), discard = its pop."""
    order = LruPolicy().order()
    seed: OrderedDict[str, None] = OrderedDict()
    for add, key in ops:
        if add:
            order.add(key)
            seed.pop(key, None)
            seed[key] = None
        else:
            order.discard(key)
            seed.pop(key, None)
        assert list(order) == list(seed)


def test_lru_admits_everything() -> None:
    policy = make_policy("lru")
    for key in "abc":
        policy.record(key)
    assert policy.admit("new", 1 << 30, ["a", "b", "c"])
    assert policy.name == "lru" and isinstance(policy, LruPolicy)


def test_tinylfu_admits_only_a_key_looked_up_more_than_every_victim() -> None:
    policy = TinyLfuPolicy(shift_drop=0)
    for key, times in (("hot", 3), ("warm", 2), ("cold", 1)):
        for _ in range(times):
            policy.record(key)
    assert policy.admit("hot", 1, ["warm", "cold"])
    assert not policy.admit("warm", 1, ["warm"])  # a tie refuses
    assert not policy.admit("warm", 1, ["cold", "hot"])  # one victim worth more refuses
    assert not policy.admit("never", 1, ["cold"])
    assert policy.admit("cold", 1, ["never"])


def test_tinylfu_counts_saturate_and_halve_every_sample() -> None:
    policy = TinyLfuPolicy(sample_factor=2, min_entries=10, max_count=4, shift_drop=0)
    for _ in range(6):
        policy.record("a")
    assert policy.estimate("a") == 4 and policy.halvings == 0
    for _ in range(13):
        policy.record("b")
    assert policy.halvings == 0  # 19 lookups; the sample is 2 x 10
    policy.record("b")
    assert policy.halvings == 1
    assert (policy.estimate("a"), policy.estimate("b")) == (2, 2)


def test_tinylfu_counts_a_resident_key_exactly_whatever_its_counters_say() -> None:
    """A resident key's count is exact from its first lookup as a resident: lookups of other
    keys that land on all its counters (planted here) raise its estimate no more, so a
    candidate looked up more often than it is admitted."""
    policy = TinyLfuPolicy(shift_drop=0)
    order = policy.order()
    policy.record("a")  # a miss
    order.add("a")  # loaded: resident
    policy.record("a")  # its exact count starts at its estimate, 1, and counts this lookup
    for _ in range(9):
        policy.sketch.add("a")  # as colliding keys would raise its counters
    policy.record("a")
    assert policy.estimate("a") == 3 and policy.sketch.estimate("a") == 10
    for _ in range(4):
        policy.record("b")
    assert policy.admit("b", 1, ["a"])


def test_tinylfu_writes_a_forgotten_keys_count_back_into_the_sketch() -> None:
    """A resident key's lookups leave the sketch alone (one dict store a hit); when its entry
    is freed, its exact count goes back into its counters, so a later miss sees it."""
    policy = TinyLfuPolicy(shift_drop=0)
    order = policy.order()
    policy.record("a")
    order.add("a")
    for _ in range(4):
        policy.record("a")
    assert policy.estimate("a") == 5 and policy.sketch.estimate("a") == 1
    order.discard("a")
    policy.forget("a")
    assert policy.estimate("a") == policy.sketch.estimate("a") == 5
    policy.record("a")
    assert policy.estimate("a") == 6


def test_tinylfu_sample_grows_with_the_resident_entries() -> None:
    policy = TinyLfuPolicy(sample_factor=1, min_entries=1, shift_drop=0)
    order = policy.order()
    for key in "abcdefgh":
        order.add(key)
    policy.record("x")  # the first sample (1 x 1) ends; the next is 1 x 8
    assert policy.halvings == 1
    for _ in range(7):
        policy.record("x")
    assert policy.halvings == 1
    policy.record("x")
    assert policy.halvings == 2
    for key in "abcdefgh":
        order.discard(key)
        policy.forget(key)
    for _ in range(7):  # the running sample keeps its size (8) ...
        policy.record("x")
    assert policy.halvings == 2
    policy.record("x")
    assert policy.halvings == 3
    policy.record("x")  # ... and the next one is 1 x max(0 resident, 1)
    assert policy.halvings == 4


def test_tinylfu_shift_compares_with_the_running_mean_of_earlier_blocks() -> None:
    """Blocks of 2 lookups with means 0.5, 2.5, ..., 14.5 (rising counts), then a block of
    mean 8.5: below 0.6 x the last block (14.5) but not below 0.6 x the running mean, which
    lags behind the rise. No shift; a block of unknown keys then is one."""
    policy = TinyLfuPolicy(min_entries=10**6, max_count=100, shift_block=2, shift_drop=0.6)
    for key in ["a", "b"] * 8 + ["a"] * 8 + ["b", "b"]:
        policy.record(key)
    assert policy.shifts == 0
    policy.record("new1")
    policy.record("new2")
    assert policy.shifts == 1 and policy.estimate("a") == 0


def run_drift(policy: Policy, switch_at: int, lookups: int, hot: int = 40) -> dict[str, int]:
    """A cache of ``hot`` entries under a stream that looks up ``a0..`` round robin, then from
    lookup ``switch_at`` on ``b0..`` instead; every miss asks admission against the oldest
    entry. Returns, for each ``b`` key, the lookup (counted from the switch) that admitted it."""
    order = policy.order()
    resident: list[str] = []
    admitted: dict[str, int] = {}
    for n in range(lookups):
        key = f"{'a' if n < switch_at else 'b'}{n % hot}"
        policy.record(key)
        if key in resident:
            order.discard(key)  # pinned by its request, released at once
            order.add(key)
            continue
        if len(resident) < hot:
            resident.append(key)
            order.add(key)
            continue
        victim = next(iter(order))
        if policy.admit(key, 1 << 20, [victim]):
            order.discard(victim)
            policy.forget(victim)
            resident.remove(victim)
            resident.append(key)
            order.add(key)
            if key.startswith("b"):
                admitted.setdefault(key, n - switch_at)
    return admitted


def test_tinylfu_follows_a_shift_within_a_few_blocks() -> None:
    """The old favourites' counts are saturated (15); the shift detector clears them, so every
    new favourite is admitted within a few blocks of 50 lookups after the switch."""
    policy = make_policy("tinylfu")
    admitted = run_drift(policy, switch_at=4000, lookups=4400)
    assert len(admitted) == 40
    assert max(admitted.values()) < 150
    assert policy.shifts == 1  # type: ignore[attr-defined]


def test_tinylfu_without_shift_detection_follows_by_halving() -> None:
    """With the detector off, the periodic halving alone ages the old counts out (a sample is
    10 x 40 lookups here; a saturated count needs up to four halvings): later, but bounded."""
    admitted = run_drift(make_policy("tinylfu", shift_drop=0), switch_at=4000, lookups=6000)
    assert len(admitted) == 40
    assert 150 <= max(admitted.values()) < 4 * 400


def test_tinylfu_without_aging_keeps_the_old_favourites() -> None:
    """The negative control: no halving within the run and no detector, so nothing new gets in
    (what the two tests above would see if aging did not work)."""
    policy = make_policy("tinylfu", sample_factor=1000, shift_drop=0)
    assert run_drift(policy, switch_at=4000, lookups=6000) == {}


def test_tinylfu_detector_stays_quiet_on_a_steady_mix() -> None:
    policy = TinyLfuPolicy()
    order = policy.order()
    for key in range(100):
        order.add(f"k{key}")
    stream = [f"k{(n * 7919) % 97 % (1 + n % 13)}" for n in range(20000)]  # skewed, stationary
    for key in stream:
        policy.record(key)
    assert policy.shifts == 0 and policy.halvings > 0


@given(
    st.lists(st.tuples(st.text(max_size=3), st.integers(1, 20)), max_size=30),
    st.integers(0, 4),
    st.integers(0, 6),
)
def test_sketch_growth_keeps_every_estimate(
    counts: list[tuple[str, int]], start: int, more: int
) -> None:
    """Doubling the width repeats each row: every key's counters keep their values, so every
    estimate (collisions included) is what it was; halving and clearing then act on all."""
    sketch = FrequencySketch(1 << start, 15)
    for key, times in counts:
        for _ in range(times):
            sketch.add(key)
    keys = [key for key, _ in counts]
    before = [sketch.estimate(key) for key in keys]
    sketch.grow(1 << (start + more))
    assert sketch.width == 1 << (start + more) and sketch.nbytes == DEPTH << (start + more)
    assert [sketch.estimate(key) for key in keys] == before
    sketch.grow(1)  # never shrinks
    assert sketch.width == 1 << (start + more)
    sketch.halve()
    assert [sketch.estimate(key) for key in keys] == [count // 2 for count in before]
    sketch.clear()
    assert not any(map(any, sketch.rows))


def test_sketch_counts_exactly_without_collisions_and_saturates() -> None:
    """Conservative update: the estimate before each add, the add, saturation at max_count;
    a never-seen key in a wide, nearly empty sketch is 0 (no collision in every row)."""
    sketch = FrequencySketch(1 << 16, 4)
    assert [sketch.add("a") for _ in range(6)] == [0, 1, 2, 3, 4, 4]
    assert sketch.estimate("a") == 4 and sketch.estimate("b") == 0


@pytest.mark.parametrize("name", ["tinylfu", "adaptive"])
def test_memory_stays_at_its_bound_however_many_keys_pass(name: str) -> None:
    """A cache of 16 entries (its sketch: 4 rows of 1024 counters; its ghosts: at most 64).
    32,000 distinct keys are looked up (31 x the width), and each lookup is followed by ten
    admissions of distinct keys against the oldest resident, nine of them never looked up (as
    request-less inserts ask admission without a lookup): 320,000 refusals or window admissions,
    5000 x the ghost bound, outrunning the periods that prune ghosts. Sketch bytes, resident
    keys and ghosts never exceed the bound for 16 entries and reach it; over the last 2,000
    lookups Python's heap (tracemalloc) stays flat."""
    policy: Any = make_policy(name)
    order = policy.order()
    for n in range(16):
        order.add(f"hot{n}")
    bound = policy.bound(16)
    assert bound.sketch_bytes == DEPTH * 1024  # 4 rows x next power of two >= 4 x 10 x 16

    def step(n: int) -> None:
        policy.record(f"{n:064x}")
        for key in [f"{n:064x}", *(f"{n:064x}-{j}" for j in range(9))]:
            victim = next(iter(order))
            if policy.admit(key, 1 << 20, [victim]):
                order.discard(victim)
                policy.forget(victim)
                order.add(key)

    worst = policy.footprint()
    for n in range(30_000):
        step(n)
        if n % 100 == 0:
            now = policy.footprint()
            assert now.within(bound), (n, now, bound)
            worst = max(worst, now, key=lambda f: (f.ghosts, f.sketch_bytes))
    assert worst.sketch_bytes == bound.sketch_bytes  # reached, not just respected
    assert worst.ghosts == (64 if name == "adaptive" else 0)
    tracemalloc.start()
    try:
        for n in range(30_000, 30_200):
            step(n)
        warm = tracemalloc.get_traced_memory()[0]
        for n in range(30_200, 32_000):
            step(n)
        end = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert policy.footprint().within(bound)
    assert end - warm < 32 << 10, (warm, end)


def test_the_core_keeps_a_policy_within_its_bound() -> None:
    """Through the core (lookups that reserve, inserts, evictions, frees), 20,000 distinct keys
    and a hot set: the policy's resident keys are never more than the entries present, and its
    footprint stays within the bound for the pool's capacity in entries (capacity // alignment)."""
    align, units = 256, 8
    policy: Any = make_policy("adaptive", min_entries=1)
    core = CacheCore(units * align, align, 4, True, policy=policy)
    bound = policy.bound(units)
    for n in range(20_000):
        keys = [f"{n:064x}", f"hot{n % 3}"]
        items = [_Thing(key, align) for key in keys]
        looked = core.begin_lookup(f"r{n}", items, False, True, False).result
        rs, fills = looked.request, looked.fills  # the reservations, filled in one step
        assert len(fills) == sum(s.status is Status.RESERVED for s in looked.statuses)
        ok = [TransferOutcome.OK] * len(fills)
        core.end_inserts(rs, fills, ok, len(items), publish=False)
        core.end_request(rs)
        assert policy.footprint().resident <= len(core.queries.entries) <= units
        assert policy.footprint().within(bound), n
    core.queries.check_invariants()
    assert core.queries.stats(0.0).evictions > 1000


class _Thing:
    """An item as the core sees it (no torch)."""

    def __init__(self, key: str, nbytes: int) -> None:
        self.key, self.nbytes, self.shape, self.dtype = key, nbytes, (1,), "u8"


def test_adaptive_drops_the_oldest_ghost_beyond_its_bound() -> None:
    """The bound is 2 x (horizon 1 + 1) x 1 entry = 4 ghosts: a fifth refusal drops the oldest,
    a key refused again becomes the newest; 10,000 refusals and no lookup leave the last 4."""
    policy = AdaptivePolicy(min_entries=1, window=0.02, step=0.5, shift_drop=0, low=0.02)
    policy.order()
    policy.record("hot")
    for key in ("k0", "k1", "k2", "k3", "k0", "k4"):
        assert not policy.admit(key, 100, ["hot"])
    assert policy.ghost_keys() == ["k2", "k3", "k0", "k4"]
    assert policy.footprint().ghosts == policy.bound(1).ghosts == 4
    for n in range(10_000):  # admissions with no lookup at all: no period ends to prune
        policy.admit(f"new{n}", 100, ["hot"])
    assert policy.ghost_keys() == [f"new{n}" for n in range(9996, 10_000)]


@pytest.mark.parametrize("name", ["tinylfu", "adaptive"])
def test_a_counting_policy_serves_one_cache(name: str) -> None:
    policy = make_policy(name)
    policy.order()
    with pytest.raises(InvalidArgumentError, match="already serves a cache"):
        policy.order()
    lru = make_policy("lru")
    assert list(lru.order()) == list(lru.order()) == []  # stateless: may serve several


@pytest.mark.parametrize(
    ("name", "knobs", "error", "named"),
    [
        ("lfu", {}, InvalidArgumentError, "'lfu'"),
        (3, {}, InvalidTypeError, "3"),
        ("lru", {"sample_factor": 2}, InvalidArgumentError, "sample_factor"),
        ("tinylfu", {"sample_factor": 0}, InvalidArgumentError, ">= 1, got 0"),
        ("tinylfu", {"max_count": 1.5}, InvalidTypeError, "max_count must be an int, got float"),
        ("tinylfu", {"max_count": 256}, InvalidArgumentError, "<= 255 (a counter is a byte)"),
        ("tinylfu", {"shift_drop": 1.0}, InvalidArgumentError, "got 1.0"),
        ("tinylfu", {"shift_drop": "0.5"}, InvalidTypeError, "'0.5'"),
        ("tinylfu", {"min_entries": True}, InvalidTypeError, "True"),
        ("tinylfu", {"window": 3}, InvalidArgumentError, "window"),
        ("adaptive", {"window": 1.5}, InvalidArgumentError, "[0, 1], got 1.5"),
        ("adaptive", {"window": 0.99}, InvalidArgumentError, "[low, high], got 0.99"),
        ("adaptive", {"low": 0.6, "high": 0.4}, InvalidArgumentError, "low 0.6 > high 0.4"),
        ("adaptive", {"horizon": 0}, InvalidArgumentError, ">= 1, got 0"),
        ("adaptive", {"step": "x"}, InvalidTypeError, "'x'"),
    ],
)
def test_bad_policy_or_knob_is_named(
    name: Any, knobs: dict[str, Any], error: type, named: str
) -> None:
    with pytest.raises(error, match=re.escape(named)):
        make_policy(name, **knobs)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``python -m benchmarks.policy.bench_policy --check-real``: each policy through a real
    ``EmbeddingCache(policy=...)`` and the benchmark's simulation on the first 400 requests of
    the quick scan mix; it exits non-zero if the two depart, else gives the real run's counts."""
    out = tmp_path_factory.mktemp("policy") / "real.json"
    command = [sys.executable, "-m", "benchmarks.policy.bench_policy", "--check-real"]
    command += ["lru", "tinylfu", "adaptive", "--requests", "400", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    runs: dict[str, dict[str, Any]] = json.loads(out.read_text())
    return runs


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "adaptive"])
def test_simulation_replays_the_real_cache_exactly(
    real_runs: dict[str, dict[str, Any]], policy: str
) -> None:
    """The policy benchmark's ``simulate`` makes the same hits, refusals and evictions as a
    real ``EmbeddingCache(policy=...)`` on a mix that evicts (so the candidates that run only
    simulated run in a faithful model)."""
    real = real_runs[policy]  # the run raised, and the fixture failed, if the two departed
    assert real["evictions"] > 0 and real["hits"] > 0
    assert (real["refused"] > 0) == (policy != "lru")
