"""TLC checks of tla/: the models pass with their recorded state counts, the mutants fail.

The TLC run (``-m tla``) takes minutes and needs Java; the other tests here check the runner
itself (patches still apply, TLC's output is read right, unexpected results are flagged)
without Java, in milliseconds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

TLA = Path(__file__).resolve().parents[2] / "tla"


def _load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tla_check", TLA / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check = _load_check()
VLLM_SPEC = "VllmConnector.tla"

VIOLATION = """\
Error: Invariant NoUseAfterFree is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ entry = (k1 :> [state |-> "ABSENT", holders |-> {}])
/\\ free = 0..1

State 2: <BeginLoad line 178, col 5 to line 188, col 46 of module EmbeddingCache>
/\\ entry = (k1 :> [state |-> "LOADING", holders |-> {}])
/\\ free = {1}

12 states generated, 9 distinct states found, 3 states left on queue.
"""


@pytest.mark.tla
@pytest.mark.timeout(1200)
def test_models_pass_and_mutants_are_rejected() -> None:
    proc = subprocess.run(
        [sys.executable, str(TLA / "check.py")], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.tla
@pytest.mark.timeout(600)
def test_vllm_mutants_break_a_design_rule_first(tmp_path: Path) -> None:
    """On VllmSaves (every invariant) a design rule rejects each vLLM mutant before any rank
    or the cache goes wrong (check.py shows that on VllmEngine): DeclaredIsPinned, or for the
    fill mutant FillHeld, for a death presumed KnownIsDead, for a fill fenced on a timeout
    WritingHeld."""
    java, jar = check.find_java(), check.find_jar()
    jobs = [check.parse_mutant(path) for path in sorted((TLA / "mutants").glob("*.mutant"))]
    vllm = [job for job in jobs if job.spec == VLLM_SPEC]
    assert len(vllm) >= 3
    for job in vllm:
        job.config = TLA / "models" / "VllmSaves.cfg"
        workdir = tmp_path / job.name
        workdir.mkdir()
        check.prepare(job, workdir)
        outcome = check.check_one(java, jar, job, workdir)
        rule = "FillHeld" if "fill" in job.name else "DeclaredIsPinned"
        if "death" in job.name:  # a death presumed, not told: the connector's own rule
            rule = "KnownIsDead"
        if "on_timeout" in job.name:  # a fill fenced with its writer not known dead
            rule = "WritingHeld"
        assert outcome.result == rule, (job.name, outcome.output[-3000:])


def test_every_mutant_patch_applies_exactly_once() -> None:
    mutants = sorted((TLA / "mutants").glob("*.mutant"))
    assert len(mutants) >= 8
    for path in mutants:
        job = check.parse_mutant(path)
        spec = (TLA / job.spec).read_text()
        assert check.mutate(spec, job) != spec, path.name
        assert job.config.is_file(), f"{path.name}: no model {job.config}"


def test_a_mutant_of_another_spec_runs_that_spec(tmp_path: Path) -> None:
    job = check.parse_mutant(TLA / "mutants" / "vllm_release_on_first_ack.mutant")
    assert (job.spec, job.mc_module) == (VLLM_SPEC, "MC" + VLLM_SPEC)
    check.prepare(job, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([VLLM_SPEC, "MC" + VLLM_SPEC])
    assert (tmp_path / VLLM_SPEC).read_text() != (TLA / VLLM_SPEC).read_text()
    bad = tmp_path / "bad.mutant"
    bad.write_text(
        "spec: NoSuchSpec\nmodel: Small\nexpect: TypeOK\n<<<<<<<\na\n=======\nb\n>>>>>>>\n"
    )
    with pytest.raises(check.CheckError, match="names no module"):
        check.parse_mutant(bad)


def test_a_stale_patch_is_an_error() -> None:
    job = check.Job("stale", "mutant", TLA / "models" / "Small.cfg", 1, "TypeOK")
    job.patches = [("text that is not in the spec", "anything")]
    with pytest.raises(check.CheckError, match="occurs 0 times"):
        check.mutate((TLA / check.SPEC).read_text(), job)


def test_tlc_output_is_read_into_a_trace_of_actions() -> None:
    assert check.classify(12, VIOLATION) == "NoUseAfterFree"
    trace = check.parse_trace(VIOLATION)
    assert [action for action, _ in trace] == ["Init", "BeginLoad"]
    text = check.format_trace(trace)
    assert 'entry[k1].state: "ABSENT" -> "LOADING"' in text
    assert "free: -0" in text


def test_a_wrong_property_or_state_count_is_unexpected() -> None:
    mutant = check.Job("m", "mutant", TLA / "models" / "Small.cfg", 1, "NoUseAfterFree")
    other = check.Outcome("PinsExact", 40, 5, 1.0, 1.0, [], "")
    assert check.verdict(mutant, other)
    accepted = check.Outcome("pass", 11668, 20, 1.0, 1.0, [], "")
    assert check.verdict(mutant, accepted)
    model = check.Job("M", "model", TLA / "models" / "Small.cfg", 2, "pass", distinct=11668)
    assert not check.verdict(model, accepted)
    assert check.verdict(model, check.Outcome("pass", 11669, 20, 1.0, 1.0, [], ""))
