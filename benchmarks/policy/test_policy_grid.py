"""``benchmarks.policy.bench_policy_grid --variant``: one policy run against a stored grid,
and the oracles it runs (``oracle_shadows``, ``cost_grid``).

These checks import the benchmarks, so they live beside them, not in ``tests/`` (whose tests
never import a benchmark: ``tests/test_layers.py``); ``tests/test_benchmarks.py`` runs this
file with pytest in a child process, so the README's test command runs them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.policy import bench_policy_grid as grid
from benchmarks.policy import cost_grid, second_offer, work_noise
from benchmarks.policy.bench_policy import simulate
from benchmarks.policy.oracle_shadows import ByteShadows
from embcache.core.policy import make_policy
from embcache.errors import InvalidArgumentError
from tests.support import mixes


@pytest.fixture(scope="module")
def tiny_run() -> dict[str, Any]:
    """The tiny grid, every contender, as ``--tiny --json`` writes it (this process's hash
    seed, so that a rerun of a policy here reproduces it exactly)."""
    cells = grid.measure(tiny=True)
    return grid.as_json(cells, grid.rows_of(cells))


def test_a_variant_that_is_the_default_reproduces_the_stored_run(tiny_run: dict[str, Any]) -> None:
    cells = grid.measure_variant("embcache.core.policy:AdaptivePolicy", tiny_run, True, False)
    stored = {row["label"]: row for row in tiny_run["cells"]}
    assert [c.label for c in cells] == [row["label"] for row in tiny_run["cells"]]
    for cell in cells:
        assert cell.saved == stored[cell.label]["saved"][grid.DEFAULT]
        assert cell.lead == cell.stored_lead == pytest.approx(stored[cell.label]["lead"])


def test_a_variant_runs_the_policy_it_names_in_place_of_the_default(
    tiny_run: dict[str, Any],
) -> None:
    cells = grid.measure_variant("embcache.core.policy:LruPolicy", tiny_run, True, False)
    for cell, row in zip(cells, tiny_run["cells"], strict=True):
        assert cell.saved == row["saved"]["lru"]  # lru's run, not the default's
        others = [row["saved"][n] for n in (*grid.BASELINES, *grid.OURS) if n != grid.DEFAULT]
        assert cell.lead == pytest.approx(cell.saved - max(others))  # lru among the others
    report = grid.variant_report("embcache.core.policy:LruPolicy", cells)
    assert report.splitlines()[-2].startswith("embcache.core.policy:LruPolicy: ")
    assert report.splitlines()[-1].startswith(f"stored {grid.DEFAULT}: ")


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("AdaptivePolicy", "module:name"),
        ("embcache.core.policy:", "module:name"),
        ("embcache.core.policy:NoSuchPolicy", "no callable 'NoSuchPolicy'"),
        ("embcache.core.sketch:DEPTH", "no callable 'DEPTH'"),
    ],
)
def test_a_bad_variant_raises_before_running(
    tiny_run: dict[str, Any], spec: str, said: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=said):
        grid.measure_variant(spec, tiny_run, True, False)


def test_a_stored_run_of_other_cells_is_refused(tiny_run: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="same --tiny / --five"):
        grid.measure_variant("embcache.core.policy:AdaptivePolicy", tiny_run, False, True)
    with pytest.raises(InvalidArgumentError, match="same --tiny / --five"):
        grid.measure_variant("embcache.core.policy:AdaptivePolicy", {}, True, False)


def test_the_byte_shadow_oracle_runs_as_a_variant(tiny_run: dict[str, Any]) -> None:
    spec = "benchmarks.policy.oracle_shadows:ByteShadows"
    cells = grid.measure_variant(spec, tiny_run, True, False)
    assert len(cells) == len(tiny_run["cells"]) and all(0 < c.saved < 100 for c in cells)


def test_the_byte_shadows_hold_at_most_the_pools_bytes_and_hit_by_bytes() -> None:
    load = mixes.Workload(
        [mixes.Spec(f"img{i}", 100 * (i + 1), torch.bfloat16) for i in range(6)], [], 4
    )
    sizes = {spec.key: mixes.aligned(spec.nbytes) for spec in load.specs}
    capacity = sizes["img0"] + sizes["img1"] + sizes["img2"]
    policy = ByteShadows(load, capacity)
    policy.order()
    for key in ["img0", "img1", "img2", "img0"]:
        policy.record(key)
    assert policy.shadow_hits() == (sizes["img0"], sizes["img0"])  # a hit weighs its bytes
    assert policy.shadow_bytes() == (capacity, capacity)
    policy.record("img3")  # the LRU shadow drops its oldest until it fits; the filter refuses
    lru_bytes, filter_bytes = policy.shadow_bytes()
    assert lru_bytes <= capacity and filter_bytes == capacity
    assert lru_bytes == sizes["img0"] + sizes["img3"]
    for _ in range(3):
        policy.record("img4")  # counted more than img1 and img2, which it displaces
    assert policy.shadow_bytes()[1] == sizes["img0"] + sizes["img4"]


def _catalogue(tokens: list[int]) -> mixes.Workload:
    return mixes.Workload(
        [mixes.Spec(f"img{i}", t, torch.bfloat16) for i, t in enumerate(tokens)], [], 4
    )


def test_the_cost_workload_scales_work_and_keeps_bytes() -> None:
    load = _catalogue([64, 512, 4096] * 50)
    costly = cost_grid.cost_workload(load, seed=3)
    assert costly.requests is load.requests
    for spec, scaled in zip(load.specs, costly.specs, strict=True):
        assert (scaled.key, scaled.nbytes) == (spec.key, spec.nbytes)
        assert spec.tokens / cost_grid.SPREAD - 1 <= scaled.tokens
        assert scaled.tokens <= spec.tokens * cost_grid.SPREAD + 1
    ratios = {round(s.tokens / t.tokens, 1) for s, t in zip(costly.specs, load.specs, strict=True)}
    assert len(ratios) > 10  # not proportional to bytes
    assert cost_grid.cost_workload(load, seed=3) == costly


def test_the_cost_filter_admits_by_lookups_times_work_per_byte() -> None:
    load = mixes.Workload(
        [
            cost_grid.CostSpec("cheap", 100, 1 << 20),
            cost_grid.CostSpec("dear", 400, 1 << 20),
            cost_grid.CostSpec("big", 400, 4 << 20),
        ],
        [],
        4,
    )
    policy = cost_grid.CostFilter(load, 1 << 30)
    policy.order()
    for key in ["cheap", "dear", "big"]:
        policy.record(key)
    # one lookup each: worth per byte decides (tinylfu would refuse all: no count is above)
    assert policy.admit("dear", 1 << 20, ["cheap"])
    assert not policy.admit("cheap", 1 << 20, ["dear"])
    assert not policy.admit("big", 4 << 20, ["dear"])  # the same work for 4x the bytes
    for _ in range(4):
        policy.record("cheap")  # 5 lookups x 100 per MiB > 1 x 400 per MiB
    assert policy.admit("cheap", 1 << 20, ["dear"])


def test_adaptive_cost_answers_as_its_expert() -> None:
    load = mixes.Workload(
        [cost_grid.CostSpec("cheap", 100, 1 << 20), cost_grid.CostSpec("dear", 400, 1 << 20)],
        [],
        4,
    )
    policy = cost_grid.CostAdaptive(load, 1 << 30)
    policy.order()
    policy.record("cheap")
    policy.record("dear")
    assert policy.use_filter
    assert policy.admit("dear", 1 << 20, ["cheap"]) and not policy.admit("cheap", 1 << 20, ["dear"])
    policy.use_filter = False  # the LRU expert admits everything
    assert policy.admit("cheap", 1 << 20, ["dear"])


def test_the_cost_run_scores_every_contender_and_the_control() -> None:
    cell = grid.cells(tiny=True)[0]
    out = cost_grid.run(cell, seed=1, requests=60)
    assert set(out) == {*cost_grid.CONTENDERS, grid.OPTIMUM, grid.OPTIMUM_COST}
    assert all(0 <= result.tokens_saved <= 100 for result in out.values())


def test_the_cost_page_reports_the_real_policy_beside_the_oracle() -> None:
    """``adaptive-work`` (the product, told each item's work at the end of its insert) runs
    beside the oracle; the page gives its lead and its distance to the oracle per cell."""
    cell = grid.cells(tiny=True)[0]
    out = cost_grid.run(cell, seed=1, requests=200)
    assert cost_grid.REAL in out and cost_grid.REAL in cost_grid.CONTENDERS
    saved = {cell: {name: result.tokens_saved for name, result in out.items()}}
    page = cost_grid.markdown(saved, five=False, seconds=1.0)
    assert "| real lead | to oracle |" in page and f"`{cost_grid.REAL}` to the oracle" in page
    gap = saved[cell][cost_grid.CHOSEN] - saved[cell][cost_grid.REAL]
    assert f"{gap:+.1f} |" in page.splitlines()[7]


def _offered_twice(calls: list[tuple[object, ...]]) -> int:
    """Admissions asked about a key twice with no lookup of it between: a request's second
    offer (each request's keys are distinct, and each lookup records its keys first)."""
    last: dict[object, str] = {}
    twice = 0
    for call in calls:
        if len(call) == 1:  # record: a lookup
            last[call[0]] = "record"
        elif len(call) == 3:  # admit
            twice += last.get(call[0]) == "admit"
            last[call[0]] = "admit"
    return twice


@pytest.mark.parametrize("name", ["tinylfu", "adaptive", "adaptive-work"])
def test_without_a_second_offer_a_refused_key_is_not_offered_again(name: str) -> None:
    """``simulate(second_offer=False)``: a key the policy refused at its request's lookup is
    not offered again at that request's insert; by default it is (the pipeline's way)."""
    cell = grid.Cell(grid.POOLS[0], "steady", grid.STEADY_SKEW, None)
    load = grid.workload(cell, seed=1, requests=600)
    runs = {}
    for second in (True, False):
        calls: list[tuple[object, ...]] = []
        result = simulate(
            load, make_policy(name), calls, capacity=cell.pool.capacity, second_offer=second
        )
        runs[second] = (_offered_twice(calls), result)
    (twice, offered), (never, single) = runs[True], runs[False]
    assert twice > 0 and offered.refused > single.refused, "the default offers again"
    assert never == 0
    assert single.lookups == offered.lookups


def test_the_second_offer_page_gives_both_ways_and_their_difference() -> None:
    cell = grid.cells(tiny=True)[0]
    out = second_offer.run(cell, seed=1, requests=200)
    assert set(out) == {
        (load, name, second)
        for load in second_offer.LOADS
        for name in second_offer.POLICIES
        for second in (True, False)
    }
    page = second_offer.markdown({cell: out}, seconds=1.0)
    row = next(line for line in page.splitlines() if line.startswith(f"| {cell.label} |"))
    with_, without = out["tokens", "tinylfu", True], out["tokens", "tinylfu", False]
    assert row.split(" | ")[1:4] == [f"{with_:.2f}", f"{without:.2f}", f"{without - with_:+.2f}"]


def test_noisy_work_is_exact_at_spread_one_and_scaled_within_the_spread() -> None:
    cell = grid.cells(tiny=True)[0]
    load = grid.workload(cell, seed=1, requests=300)
    capacity = cell.pool.capacity
    exact = simulate(load, make_policy("adaptive-work"), capacity=capacity)
    one = simulate(load, work_noise.NoisyWork(1.0, seed=1), capacity=capacity)
    fields = ("hits", "hit_tokens", "refused", "failed", "evictions")
    assert [getattr(one, f) for f in fields] == [getattr(exact, f) for f in fields]
    noisy = work_noise.NoisyWork(4.0, seed=1)
    told = []
    for n in range(20):
        noisy.note_work(f"k{n}", 1.0, 1000)
        told.append(noisy._work[f"k{n}"] * 1000)  # the seconds it remembers
    assert all(1 / 4 <= t <= 4 for t in told) and len(set(told)) == len(told)
    out = work_noise.run(cell, seed=1, requests=200)
    assert set(out) == {"adaptive", "x1", "x2", "x4"}
    page = work_noise.markdown({cell: out}, seconds=1.0)
    assert f"| {cell.label} | {out['adaptive']:.2f} | {out['x1']:.2f} |" in page
