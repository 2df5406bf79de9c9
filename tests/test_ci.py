"""The CI scripts against the README and the suite: what the README says is what CI runs, and
the test tiers' steps select every test exactly once (``.ci/test`` in its dry-run mode, which
only collects)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("install", "test", "run", "fresh_clone", "engine_env")
WHOLE_TLC_RUN = "tests/tla/test_tla.py::test_models_pass_and_mutants_are_rejected"

pytestmark = pytest.mark.timeout(180)


def readme_commands() -> list[str]:
    """The lines of the README's first bash block, comments removed."""
    block = re.search(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert block, "README.md has no bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines()]


def test_the_readme_shows_the_set_up_and_the_test_command_ci_runs() -> None:
    setup, tests = readme_commands()
    assert setup.startswith("bash .ci/install && ")
    assert "python -m embcache demo" in setup and " python " not in f" {setup} ", "no bare python"
    assert tests == "bash .ci/test"
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in run, ".ci/run runs exactly the README's test command"
    assert "bash .ci/test --engine || status=1" in run, ".ci/run runs the engine tier"
    assert "bash .ci/fresh_clone || status=1" in run


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_ci_scripts_parse(script: str) -> None:
    path = ROOT / ".ci" / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)


def collected(*args: str) -> tuple[Counter[str], str]:
    """The test ids ``.ci/test ARGS`` would run (dry run) and its whole output."""
    done = subprocess.run(
        ["bash", ".ci/test", *args],
        cwd=ROOT,
        env={**os.environ, "EMBCACHE_CI_DRY_RUN": "1", "EMBCACHE_CI_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    ids = Counter(line for line in done.stdout.splitlines() if "::" in line)
    return ids, done.stdout


@functools.cache
def collect(*args: str) -> frozenset[str]:
    """The test ids plain pytest collects with ``args`` (once per ``args`` in a session)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "--verbosity=-1", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return frozenset(line for line in done.stdout.splitlines() if "::" in line)


def test_the_full_tier_runs_every_test_once_and_tlc_over_every_model() -> None:
    every = collect()
    steps, output = collected()
    assert steps and max(steps.values()) == 1, [t for t, n in steps.items() if n > 1]
    assert WHOLE_TLC_RUN not in steps, "run by tla/check.py in its own step instead"
    assert set(steps) | {WHOLE_TLC_RUN} == every - collect("-m", "engine")
    assert re.search(r"^model +Small ", output, re.M), "tla/check.py lists its runs"


def test_the_engine_tier_is_the_engine_tests_and_only_there() -> None:
    engine, _ = collected("--engine")
    assert engine and max(engine.values()) == 1
    assert set(engine) == collect("-m", "engine")  # and the full tier has none of them (above)
    assert all(test.startswith("tests/engine/") for test in engine)


def test_the_quick_tier_is_every_test_but_tlc_mooncake_stress_crosshair_and_engine() -> None:
    quick, _ = collected("--quick")
    assert quick and max(quick.values()) == 1
    slow = collect("-m", "tla or mooncake or stress or crosshair or engine")
    assert set(quick) == collect() - slow
