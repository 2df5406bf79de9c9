"""``benchmarks.policy.bench_policy_grid --variant``: one policy run against a stored grid."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.policy import bench_policy_grid as grid
from embcache.errors import InvalidArgumentError


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
        ("embcache.core.policy:DEPTH", "no callable 'DEPTH'"),
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
