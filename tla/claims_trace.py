#!/usr/bin/env python3
"""Trace validation of fleet claims: a worker's ``FleetClaims`` events against FleetClaims.tla.

A trace is what ``FleetClaims(trace=...)`` recorded (JSON lines or a list of events; the module
docstring of ``embcache/pipeline/claims.py``, "Trace"). It is split by key (keys share nothing
in the spec but the clock), each event's clock reading becomes a tick (``LEASE_TICKS`` ticks per
lease, the store's ``claim_lease_s``, which the worker's own ``lease_s`` must not undercut;
counted from a lease before ``Init``), and ``TraceFleetClaims.tla`` follows each key's events
as steps of the worker ``me`` in a fleet of ``workers`` workers whose other steps, and the
master's, are hidden. TLC explores every state that follows a trace this way; a trace is
accepted iff some state has explained its last event, else it is rejected at the first event
no state explains (read from TLC's dump of the states).

    python tla/claims_trace.py --workers N FILE...

Of a wait's ``Poll`` ``taken`` events only the first in each tick is kept: the others repeat
it (the spec's poll that changes nothing). Events a spec step cannot be (``none``: no master,
``load_failed``, a release at close) are kept and explain nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SPECS = ("FleetClaims.tla", "TraceFleetClaims.tla")
LEASE_TICKS = 2  # the spec's Lease: a tick is half a lease
CLAIMS_WAITED = 2  # the spec's ClaimsWaited (embcache/pipeline/claims.py's CLAIMS_WAITED)
FAULTS = ("crash", "slow", "fail")  # what the hidden workers may do (no master restart)
ME = "me"
JVM_OPTS = ["-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss16m"]


class TraceError(Exception):
    """A trace that cannot be converted (not a trace of ``FleetClaims``)."""


@dataclasses.dataclass
class KeyTrace:
    """One key's events in the spec's terms (``events``) and as recorded (``source``)."""

    name: str
    events: list[dict[str, Any]]
    source: list[dict[str, Any]]


@dataclasses.dataclass
class Verdict:
    """What the spec says of one key's trace: accepted, or the first event not explained."""

    name: str
    accepted: bool
    events: int
    event: dict[str, Any] | None = None

    def describe(self) -> str:
        if self.accepted:
            return f"{self.name}: accepted ({self.events} events)"
        return f"{self.name}: REJECTED at {self.event} (no behaviour of the fleet explains it)"


def convert(events: list[dict[str, Any]], name: str = "trace") -> list[KeyTrace]:
    """One ``KeyTrace`` per key of a worker's trace, in order of each key's first event."""
    ordered = sorted(events, key=lambda e: int(e["seq"]))
    if not ordered or ordered[0].get("action") != "Init":
        raise TraceError(f"{name}: the first event must be Init")
    init = ordered[0]
    lease = float(init["claim_lease_s"])
    origin, tick = float(init["t"]) - lease, lease / LEASE_TICKS  # (claims live at Init began
    # at most a lease before it: the hidden steps can take them in their own ticks)
    per_key: dict[str, KeyTrace] = {}
    for ev in ordered[1:]:
        key = ev.get("key")
        if not key:
            raise TraceError(f"{name}: seq {ev['seq']}: an event without a key")
        trace = per_key.setdefault(key, KeyTrace(f"{name}[{key}]", [], []))
        n = math.floor((float(ev["t"]) - origin) / tick)
        if n < 0:
            raise TraceError(f"{name}: seq {ev['seq']}: a time before Init")
        record = {"a": ev["action"], "out": ev.get("outcome") or "", "n": n}
        if record["a"] == "Poll" and record["out"] == "taken" and any(
            kept["n"] == n for kept in trace.events
        ):
            continue  # a poll that repeats one of this tick
        trace.events.append(record)
        trace.source.append(ev)
    return list(per_key.values())


def _tla(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "[" + ", ".join(f"{k} |-> {_tla(v)}" for k, v in value.items()) + "]"
    if isinstance(value, (list, tuple)):
        return "<<" + ", ".join(_tla(v) for v in value) + ">>"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(_tla(v) for v in sorted(value)) + "}"
    raise TypeError(value)


def module_text(name: str, traces: list[KeyTrace], workers: int) -> str:
    """A module that instantiates the trace spec with these traces and a fleet of ``workers``."""
    table: dict[str, int] = {}
    rows = []
    for trace in traces:
        rows.append([table.setdefault(_tla(e), len(table) + 1) for e in trace.events])
    fleet = {ME} | {f"w{j}" for j in range(1, workers)}
    return "\n".join([
        f"---- MODULE {name} ----",
        "\\* Generated by tla/claims_trace.py: one worker's claim traces, one per key.",
        "EXTENDS Integers, Sequences",
        "VARIABLES data, claim, ws, encodes, restarts, t, i, now",
        "E == <<" + ",\n".join(table) + ">>",
        "T == <<" + ",\n".join(_tla(row) for row in rows) + ">>",
        f"G == INSTANCE TraceFleetClaims WITH Workers <- {_tla(fleet)}, Keys <- {{\"k\"}}, "
        f"Lease <- {LEASE_TICKS}, ClaimsWaited <- {CLAIMS_WAITED}, Faults <- {_tla(set(FAULTS))}, "
        f"Garbage <- \"garbage\", Me <- {_tla(ME)}, Events <- E, Traces <- T",
        "Init == G!TraceInit",
        "Next == G!TraceNext",
        "====",
    ]) + "\n"  # fmt: skip


STATE_RE = re.compile(r"^/\\ (t|i) = (\d+)$", re.M)


def furthest(dump: str) -> dict[int, int]:
    """Per trace number (1-based), the largest ``i`` of any state in TLC's dump."""
    reached: dict[int, int] = {}
    for block in dump.split("State ")[1:]:
        values = dict(STATE_RE.findall(block))
        if "t" in values and "i" in values:
            t, i = int(values["t"]), int(values["i"])
            reached[t] = max(reached.get(t, 0), i)
    return reached


def _check_module() -> Any:
    """tla/trace.py's loader of tla/check.py (the jar and Java lookup)."""
    import importlib.util

    if "tla_trace" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tla_trace", HERE / "trace.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["tla_trace"]._check_module()


def validate(
    traces: list[tuple[str, list[dict[str, Any]]]], workers: int, tlc_workers: int = 1
) -> list[Verdict]:
    """Check each worker's trace (name, events) against the spec, in a fleet of ``workers``;
    one ``Verdict`` per key of each trace, in order."""
    if workers < 1:
        raise TraceError(f"a fleet has at least one worker, got {workers}")
    keyed = [kt for name, events in traces for kt in convert(events, name)]
    if not keyed:
        return []
    check = _check_module()
    jar, java = check.find_jar(), check.find_java()
    with tempfile.TemporaryDirectory(prefix="embcache-claims-trace-") as tmp:
        work = Path(tmp)
        for spec in SPECS:
            shutil.copy(HERE / spec, work / spec)
        module = "ClaimsTraceBatch"
        (work / f"{module}.tla").write_text(module_text(module, keyed, workers))
        (work / f"{module}.cfg").write_text("INIT Init\nNEXT Next\n")
        cmd = [
            java, *JVM_OPTS, f"-Djava.io.tmpdir={work}", "-cp", str(jar), "tlc2.TLC",
            "-deadlock", "-workers", str(tlc_workers), "-metadir", str(work / "meta"),
            "-dump", str(work / "states"), "-config", f"{module}.cfg", module,
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0 or "Model checking completed" not in output:
            raise check.CheckError("TLC failed on the claims traces:\n" + output[-3000:])
        reached = furthest((work / "states.dump").read_text())
    verdicts = []
    for number, kt in enumerate(keyed, 1):
        i = reached.get(number, 1)
        if i > len(kt.events):
            verdicts.append(Verdict(kt.name, True, len(kt.events)))
        else:
            verdicts.append(Verdict(kt.name, False, len(kt.events), kt.source[i - 1]))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument("--workers", type=int, required=True, help="the fleet's size")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.files:
        with open(path, encoding="utf-8") as source:
            loaded.append((str(path), [json.loads(line) for line in source if line.strip()]))
    verdicts = validate(loaded, args.workers)
    for verdict in verdicts:
        print(verdict.describe())
    return 0 if all(v.accepted for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
