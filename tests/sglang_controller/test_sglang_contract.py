"""MMEncoder's exact call sequence, on 2 gloo ranks, against embcache's SGLang controllers
(scenarios in ``scenarios.py``, the replay in ``tests/support/sglang_mmencoder.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_controller import scenarios
from tests.support.rank_scenarios import report, run_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    outdir: Path = tmp_path_factory.mktemp("sglang-contract")
    outcomes, _ = run_ranks("tests.sglang_controller.scenarios", outdir, {})  # exits: in outcomes
    return outcomes


@pytest.mark.parametrize("scenario", [s.__name__ for s in scenarios.SCENARIOS])
def test_mmencoder_sequence(outcomes: dict[int, dict[str, str]], scenario: str) -> None:
    report(outcomes, scenario)
