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
PURE_STEP = "full tier 6/6: unit tests again on the pure core"
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
    assert run[-1] == "bash .ci/fresh_clone --engine", ".ci/run is the fresh clone's run"
    fresh = (ROOT / ".ci" / "fresh_clone").read_text()
    for line in (
        "setup=$(readme_line 1)",  # the README's set-up command, from its first bash block
        "tests=$(readme_line 2)",  # and exactly its test command, the line after
        'system_env "README set-up command" "$setup"',
        'system_env "README test command" "$tests"',
        '[ $engine = 1 ] && system_env "engine tier" "bash .ci/test --engine"',
    ):
        assert line in fresh.splitlines() or f"    {line}" in fresh.splitlines(), line


def test_the_fresh_clone_runs_the_readme_commands_in_the_system_environment(
    tmp_path: Path,
) -> None:
    """``.ci/fresh_clone`` on a stand-in repository: it runs the README's two commands, in
    order, from a clone of HEAD, with PATH cut down to the system's and no other variable but
    HOME (and CI when set); --engine adds the engine tier; a failing step fails the run."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "fresh_clone").write_text((ROOT / ".ci" / "fresh_clone").read_text())
    log = tmp_path / "log"
    (repo / ".ci" / "install").write_text(f'echo "install $PATH ${{VIRTUAL_ENV:-}}" >> {log}\n')
    (repo / ".ci" / "test").write_text(f'echo "test $* ${{CI:-}}" >> {log}\n[ "$1" != --engine ]\n')
    (repo / "README.md").write_text(
        "# x\n```bash\nbash .ci/install && true  # set up\nbash .ci/test  # test\n```\n"
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=30)
    subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True, timeout=30)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "x"], check=True, timeout=30)

    def run(*args: str) -> int:
        log.write_text("")
        env = {**os.environ, "VIRTUAL_ENV": "/somewhere", "CI": "yes"}
        done = subprocess.run(
            ["bash", ".ci/fresh_clone", *args], cwd=repo, env=env, timeout=60, check=False
        )
        return done.returncode

    assert run() == 0
    assert log.read_text().splitlines() == ["install /usr/sbin:/usr/bin:/sbin:/bin ", "test  yes"]
    assert run("--engine") == 1, "the engine step failed, so the run fails"
    assert log.read_text().splitlines()[1:] == ["test  yes", "test --engine yes"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_ci_scripts_parse(script: str) -> None:
    path = ROOT / ".ci" / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)


@functools.cache
def collected(*args: str) -> tuple[Counter[str], str]:
    """The test ids ``.ci/test ARGS`` would run (dry run) and its whole output (once per
    ``args`` in a session)."""
    done = subprocess.run(
        ["bash", ".ci/test", *args],
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if k != "EMBCACHE_PURE"},  # the pure step's
            "EMBCACHE_CI_DRY_RUN": "1", "EMBCACHE_CI_PYTHON": sys.executable,
        },
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    ids = Counter(line for line in done.stdout.splitlines() if "::" in line)
    return ids, done.stdout


def ids_in(output: str) -> Counter[str]:
    return Counter(line for line in output.splitlines() if "::" in line)


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
    _, output = collected()
    # the last step runs the unit tests again on the pure core (below)
    compiled, _, pure = output.partition(f"== test: {PURE_STEP}")
    steps = ids_in(compiled)
    assert pure and steps and max(steps.values()) == 1, [t for t, n in steps.items() if n > 1]
    assert WHOLE_TLC_RUN not in steps, "run by tla/check.py in its own step instead"
    assert set(steps) | {WHOLE_TLC_RUN} == every - collect("-m", "engine")
    assert re.search(r"^model +Small ", output, re.M), "tla/check.py lists its runs"


def test_the_full_tier_runs_the_unit_tests_again_on_the_pure_core() -> None:
    """Step 6 collects the unit tests of step 1 with EMBCACHE_PURE=1 (the run-time switch) and
    expects that build; the other steps expect the build .ci/install made (compiled, unless it
    was told EMBCACHE_PURE=1: then there is no pure step to add, so it is skipped)."""
    _, output = collected()
    compiled, _, pure = output.partition(f"== test: {PURE_STEP}")
    unit, _, _ = compiled.partition("== test: full tier 2/6")
    assert ids_in(pure) and ids_in(pure) == ids_in(unit)
    script = (ROOT / ".ci" / "test").read_text()
    assert "EMBCACHE_PURE=1 EMBCACHE_EXPECT_BUILD=pure HYPOTHESIS_PROFILE=dev \\\n" in script
    assert "export EMBCACHE_EXPECT_BUILD=$built" in script
    assert '[ "${EMBCACHE_PURE:-}" = 1 ] && built=pure' in script
    assert 'step "full tier 6/6: skipped: the core is pure already (EMBCACHE_PURE=1)"' in script


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


@pytest.mark.parametrize("seed", [None, "1234"])
def test_a_run_names_its_hash_seed_so_a_failure_reruns_alike(seed: str | None) -> None:
    """``.ci/test`` prints the run's PYTHONHASHSEED first: drawn when unset, kept when set."""
    env = {k: v for k, v in os.environ.items() if k not in ("EMBCACHE_PURE", "PYTHONHASHSEED")}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env |= {"EMBCACHE_CI_DRY_RUN": "1", "EMBCACHE_CI_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", ".ci/test", "tests/test_docs.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    named = re.findall(r"^test: PYTHONHASHSEED=(\d+) ", done.stdout, re.MULTILINE)
    assert len(named) == 1 and done.returncode == 0, done.stdout[-2000:]
    assert seed is None or named == [seed]


def test_pytests_header_names_the_hash_seed() -> None:
    """pytest's header names PYTHONHASHSEED (``tests/conftest.py``), or says it is unset."""
    for seed, said in (("77", "PYTHONHASHSEED=77: rerun"), (None, "PYTHONHASHSEED unset")):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "tests/test_docs.py"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert said in done.stdout, done.stdout[:1000]
