"""MMEncoder's call sequence on 2 gloo ranks with a real ``mooncake_master`` (loopback TCP):
two controllers sharing it, and a master that dies (``scenarios_mooncake.py``)."""

from __future__ import annotations

import pytest

from embcache.store.mooncake_master import MooncakeMaster
from tests.sglang_controller import scenarios_mooncake
from tests.support import ports
from tests.support.rank_scenarios import report, run_ranks

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def outcomes(
    mooncake_master: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, str]]:
    args = {
        "store": mooncake_master.store_kwargs(),
        "prefix": f"sglang-{tmp_path_factory.mktemp('p').name}/",
        "binary": mooncake_master.binary,
        "master_ports": ports.server_ports(3),  # the master rank 0 starts (and kills)
    }
    outcomes, _ = run_ranks(  # a rank's non-zero exit code is in its outcomes
        "tests.sglang_controller.scenarios_mooncake",
        tmp_path_factory.mktemp("sglang-mooncake"),
        args,
        deadline_s=200.0,
    )
    return outcomes


@pytest.mark.parametrize("scenario", [s.__name__ for s in scenarios_mooncake.SCENARIOS])
def test_mmencoder_sequence_on_mooncake(outcomes: dict[int, dict[str, str]], scenario: str) -> None:
    report(outcomes, scenario)
