#!/usr/bin/env python3
"""Trace validation: check that runs of the real cache are behaviours of EmbeddingCache.

A trace (JSON lines written by ``embcache.driver.trace.TraceLog``) becomes a sequence of TLA+ event
records in a generated module; ``TraceEmbeddingCache.tla`` follows it step by step, taking the
spec action each event names and checking the entry's logged post-state, with the spec's
invariants checked in every state. Many traces are checked in one TLC run: the generated module
holds one instance of the trace spec per pool geometry (units, eviction batch), each with its
traces, and TLC picks the trace in the initial state. TLC stops at the first trace it cannot
follow; that trace is set aside and the run repeated without it, and each rejected trace is then
rerun alone with diagnostics that say which part of its step failed.

    python tla/trace.py FILE...          (or: python tla/check.py --trace FILE...)

Mapping: keys stay strings; the code's request ids (reused over time) become the spec's request
slots, a slot taken at OpenRequest and given back at CloseRequest; a publish pin keeps the slot
of the request that published, which may have closed (and its slot been reused) before the
EndPublish; the code's fence ids become the spec's fence slots the same way (taken at BeginFence,
given back at Fence: fences may overlap); bytes become units of the trace's alignment.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
SPEC = "EmbeddingCache.tla"
TRACE_SPEC = "TraceEmbeddingCache.tla"
SPEC_VARIABLES = [
    "entry", "free", "order", "transfers", "zombies", "request", "fencing", "snapshot",
]  # fmt: skip
INVARIANTS = [
    "TypeOK", "NoOverlap", "Accounting", "PinsExact", "NoUseAfterFree", "EvictableExact",
    "DoomedIsBusy", "QuarantineHolds",
]  # fmt: skip
DIAGNOSTICS = ["ActionEnabled", "ActionMatches", "EventExplained", "BeforeLaxEvent"]
JVM_OPTS = ["-XX:+UseParallelGC", "-Xss64m"]
NO_REQUEST = -1  # the spec's NoRequest; slot 0 is never opened (ids that are not open)


def _outcome(ev: dict[str, Any]) -> str:
    """The event's outcome; a Lookup miss carries its reason ("MISS:not_found")."""
    outcome: str = ev.get("outcome") or ""
    if ev["action"] == "Lookup" and outcome == "MISS" and ev.get("reason"):
        return f"MISS:{ev['reason']}"
    return outcome


def _check_module() -> ModuleType:
    """tla/check.py, for the jar and Java lookup and its reader of TLC's counterexamples."""
    if "tla_check" in sys.modules:
        return sys.modules["tla_check"]
    spec = importlib.util.spec_from_file_location("tla_check", HERE / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class TraceError(Exception):
    """A trace that cannot be converted (not a trace of the cache)."""


# ------------------------------------------------------------------------ conversion


@dataclasses.dataclass
class Converted:
    """One trace in the spec's terms."""

    name: str
    units: int
    batch: int  # MaxEvictionBatch: 0 when eviction is disabled
    events: list[dict[str, Any]]  # TLA+ event records (see TraceEmbeddingCache.tla)
    source: list[dict[str, Any]]  # the code's event for each record
    names: list[dict[str, int]]  # per record: the slots of the request ids its event names
    keys: set[str]
    slots: int  # request slots used
    fences: int = 0  # fence slots used (the most fences in flight at once)


def convert(events: list[dict[str, Any]], name: str = "trace") -> Converted:
    """Map a trace of the code to the trace spec's event records."""
    if not events or events[0].get("action") != "Init":
        raise TraceError(f"{name}: the first event must be Init")
    init = events[0]
    align = int(init["alignment"])
    units = int(init["capacity"]) // align
    batch = int(init["max_eviction_batch"]) if init.get("enable_eviction", True) else 0
    slot_of: dict[str, int] = {}  # open request id -> slot
    publish_slot: dict[tuple[str, str], int] = {}  # (request id, key) -> slot of its publish
    stranger = 0  # the slot for an id that is not open: never opened, so every guard fails
    keys: set[str] = set()
    out: list[dict[str, Any]] = []
    source: list[dict[str, Any]] = []
    names: list[dict[str, int]] = []
    victims: set[str] = set()
    max_slot = 0
    fence_slot_of: dict[int, int] = {}  # fence id in flight -> slot
    max_fence = 0

    def units_of(nbytes: int, what: str, exact: bool = True) -> int:
        if exact and nbytes % align:
            raise TraceError(f"{name}: {what} {nbytes} is not a multiple of {align}")
        return -(-nbytes // align)

    def slot(rid: str) -> int:
        return slot_of.get(rid, stranger)

    for ev in events[1:]:
        action = ev["action"]
        rid: str = ev.get("request") or ""  # "" for none: never open
        key: str = ev.get("key") or ""
        if key:
            keys.add(key)
        rec: dict[str, Any] = {
            "a": action, "seq": ev["seq"], "r": 0, "k": key, "n": 0, "o": 0,
            "out": _outcome(ev), "e": "state" in ev, "st": ev.get("state", ""),
            "h": set(), "w": set(), "p": NO_REQUEST, "d": bool(ev.get("doomed", False)),
            "q": bool(ev.get("tainted", False)), "V": set(), "Q": set(ev.get("keys") or []),
            "at": int(ev.get("position", -1)), "f": 0, "x": False,
        }  # fmt: skip
        keys |= rec["Q"]
        if action in ("BeginFence", "Fence") and "fence" not in ev:
            raise TraceError(
                f"{name}: seq {ev['seq']}: a {action} event without its fence id (a trace "
                "recorded before fences had two steps): record it again"
            )
        if action == "BeginFence":
            busy = set(fence_slot_of.values())
            rec["f"] = min(f for f in range(1, len(busy) + 2) if f not in busy)
            fence_slot_of[int(ev["fence"])] = rec["f"]
            max_fence = max(max_fence, rec["f"])
        elif action == "Fence":
            rec["f"] = fence_slot_of.pop(int(ev["fence"]), 0)  # 0: never begun, never in flight
        if action == "OpenRequest":
            if rid in slot_of:
                raise TraceError(f"{name}: seq {ev['seq']}: request {rid!r} opened twice")
            used = set(slot_of.values())
            rec["r"] = slot_of[rid] = min(s for s in range(1, len(used) + 2) if s not in used)
            max_slot = max(max_slot, rec["r"])
        elif action == "CloseRequest":
            rec["r"] = slot(rid)
            slot_of.pop(rid, None)
        elif action == "EndPublish":
            rec["r"] = publish_slot.pop((rid, key), stranger)
        else:
            rec["r"] = slot(rid)
            if action == "Publish":
                publish_slot[(rid, key)] = rec["r"]
        if "size" in ev:
            exact = rec["e"]  # a failed BeginLoad logs the bytes it asked for, not rounded
            rec["n"] = units_of(int(ev["size"]), "size", exact)
        if "offset" in ev:
            rec["o"] = units_of(int(ev["offset"]), "offset")
        for holder in ev.get("holders", []):
            if holder.startswith("publish:"):
                rec["p"] = publish_slot.get((holder[len("publish:") :], key), stranger)
            else:
                rec["h"].add(slot(holder))
        rec["w"] = {slot(w) for w in ev.get("waiters", [])}
        if action == "Evict":
            victims.add(key)
        elif action == "BeginLoad":  # failed or refused: the spec checks that V is empty
            rec["V"], victims = victims, set()
        elif victims:
            # Evict events not followed by the BeginLoad that needed them: the first one
            # becomes a step no spec action explains.
            _orphan_evicts(out)
            victims = set()
        out.append(rec)
        source.append(ev)
        ids = [rid, *ev.get("waiters", []), *(h.split(":")[-1] for h in ev.get("holders", []))]
        names.append({r: slot_of[r] for r in ids if r in slot_of})
    if victims:
        _orphan_evicts(out)
    return Converted(name, units, batch, out, source, names, keys, max_slot, max_fence)


def _orphan_evicts(out: list[dict[str, Any]]) -> None:
    """The trailing run of Evict events has no BeginLoad: its first becomes unexplainable."""
    first = len(out)
    while first > 0 and out[first - 1]["a"] == "Evict":
        first -= 1
    out[first]["a"] = "EvictWithoutBeginLoad"


# ------------------------------------------------------------------------ TLA+ text


def tla(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(tla(v) for v in sorted(value)) + "}"
    if isinstance(value, dict):
        return "[" + ", ".join(f"{k} |-> {tla(v)}" for k, v in value.items()) + "]"
    if isinstance(value, (list, tuple)):
        return "<<" + ", ".join(tla(v) for v in value) + ">>"
    raise TypeError(value)


def group_key(trace: Converted) -> tuple[int, int]:
    return trace.units, trace.batch


def module_text(name: str, traces: list[Converted]) -> tuple[str, list[tuple[int, int]]]:
    """The batch module and, per group number g, the (units, batch) of its instance."""
    groups: dict[tuple[int, int], list[Converted]] = {}
    for trace in traces:
        groups.setdefault(group_key(trace), []).append(trace)
    keys = set().union(*(trace.keys for trace in traces)) or {"none"}
    slots = max(trace.slots for trace in traces)
    fences = max(trace.fences for trace in traces)
    lines = [
        f"---- MODULE {name} ----",
        "\\* Generated by tla/trace.py: traces of the cache, one instance of the trace spec",
        "\\* per pool geometry.  Not to be edited.",
        "EXTENDS Integers, Sequences",
        f"VARIABLES {', '.join(SPEC_VARIABLES)}, t, i, g",
        f"K == {tla(keys)}",
    ]
    order = list(groups)
    table: dict[str, int] = {}  # distinct event records (seq left out), numbered from 1

    def index(event: dict[str, Any]) -> str:
        return str(table.setdefault(tla({k: v for k, v in event.items() if k != "seq"}),
                                    len(table) + 1))  # fmt: skip

    for number, (units, batch) in enumerate(order, 1):
        lines.append(f"T{number} == <<")
        lines.append(",\n".join("<<" + ",".join(index(e) for e in tr.events) + ">>"
                                for tr in groups[(units, batch)]))  # fmt: skip
        lines.append(">>")
        lines.append(
            f"G{number} == INSTANCE TraceEmbeddingCache WITH Units <- {units}, Keys <- K, "
            f"Requests <- 0..{slots}, Sizes <- {{}}, MaxEvictionBatch <- {batch}, "
            f"Fences <- 1..{fences}, NoRequest <- {NO_REQUEST}, Events <- E, "
            f"Traces <- T{number}"
        )
    lines.insert(6, "E == <<" + ",\n".join(table) + ">>")
    n = len(order)
    inits = " \\/ ".join(f"(g = {j} /\\ G{j}!TraceInit)" for j in range(1, n + 1))
    lines.append(f"Init == {inits}")
    lines.append(
        "Next == g' = g /\\ ("
        + " \\/ ".join(f"(g = {j} /\\ G{j}!TraceNext)" for j in range(1, n + 1))
        + ")"
    )
    for inv in INVARIANTS + DIAGNOSTICS:
        arms = " [] ".join(f"g = {j} -> G{j}!{inv}" for j in range(1, n + 1))
        lines.append(f"{inv} == CASE {arms}")
    lines.append("====")
    # The groups' traces in module order, to map (g, t) back to a trace.
    return "\n".join(lines) + "\n", order


# ------------------------------------------------------------------------ running TLC


@dataclasses.dataclass
class Verdict:
    """What the spec says of one trace."""

    name: str
    accepted: bool
    events: int
    why: str = ""  # "Deadlock", an invariant, a diagnostic or "error"
    index: int | None = None  # the index (0-based, Init excluded) of the event not explained
    event: dict[str, Any] | None = None  # the code's event there
    state: dict[str, object] | None = None  # the spec's state there
    detail: str = ""
    slots: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> slot there

    @property
    def seq(self) -> int | None:
        return None if self.event is None else int(self.event["seq"])

    def describe(self) -> str:
        if self.accepted:
            return f"{self.name}: accepted ({self.events} events)"
        ev = self.event or {}
        head = (
            f"{self.name}: REJECTED at seq {ev.get('seq')} {ev.get('action')} "
            f"key={ev.get('key')!r} request={ev.get('request')!r} outcome={ev.get('outcome')!r}"
        )
        return "\n".join(filter(None, [head, f"  {self.detail}" if self.detail else "",
                                       self.state_text()]))  # fmt: skip

    def state_text(self) -> str:
        if not self.state:
            return ""
        key = (self.event or {}).get("key")
        keys = {key} | set((self.event or {}).get("keys") or [])
        lines = [f"  spec state there (request slots: {self.slots}):"]
        for path, value in self.state.items():
            show = (
                path.split("[")[0] in ("free", "order", "zombies")
                or any(
                    path.startswith(f'entry["{k}"]') or path.startswith(f"entry[{k}]")
                    for k in keys
                    if k
                )
                or path.startswith("request")
            )
            if show:
                lines.append(f"    {path} = {_check_module().render(value)}")
        return "\n".join(lines)


def run_tlc(workdir: Path, module: str, invariants: list[str], workers: int) -> tuple[int, str]:
    check = _check_module()
    jar, java = check.find_jar(), check.find_java()
    cfg = workdir / f"{module}.cfg"
    cfg.write_text("INIT Init\nNEXT Next\nINVARIANTS\n" + "".join(f"    {n}\n" for n in invariants))
    metadir = Path(tempfile.mkdtemp(prefix="meta-", dir=workdir))
    cmd = [
        java, *JVM_OPTS, f"-Djava.io.tmpdir={workdir}", "-cp", str(jar), "tlc2.TLC",
        "-workers", str(workers), "-metadir", str(metadir), "-config", cfg.name, module,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    shutil.rmtree(metadir, ignore_errors=True)
    return proc.returncode, proc.stdout + proc.stderr


FAIL_RE = re.compile(r"^Error: (?:Invariant (\w+) is violated|(Deadlock) reached)", re.M)


def _counterexample_end(output: str) -> dict[str, object] | None:
    check = _check_module()
    steps = check.parse_trace(output)
    if not steps:
        return None
    values: dict[str, object] = check.state_values(steps[-1][1])
    return values


def _run_batch(
    workdir: Path, traces: list[Converted], invariants: list[str], workers: int, tag: str
) -> tuple[bool, str, str, Converted | None, dict[str, object] | None]:
    """(all accepted, why, TLC output, the rejected trace, its last state)."""
    module = f"TraceBatch{tag}"
    text, order = module_text(module, traces)
    (workdir / f"{module}.tla").write_text(text)
    returncode, output = run_tlc(workdir, module, invariants, workers)
    if "Model checking completed. No error has been found." in output and returncode == 0:
        return True, "", output, None, None
    m = FAIL_RE.search(output)
    why = (m.group(1) or m.group(2)) if m else "error"
    state = _counterexample_end(output)
    if not state or not all(v in state for v in ("g", "t", "i")):
        return False, why, output, None, state
    group = order[int(str(state["g"])) - 1]
    members = [tr for tr in traces if group_key(tr) == group]
    return False, why, output, members[int(str(state["t"])) - 1], state


def _verdict(trace: Converted, why: str, state: dict[str, object]) -> Verdict:
    i = int(str(state["i"])) - 1  # the 0-based index of the next event
    if why in INVARIANTS:  # the previous event led to a state the invariant rejects
        i -= 1
    spec_state = {
        path: value for path, value in state.items() if path.split("[")[0] in SPEC_VARIABLES
    }
    index = min(max(i, 0), len(trace.source) - 1)
    verdict = Verdict(trace.name, False, len(trace.events), why, index, trace.source[index],
                      spec_state)  # fmt: skip
    verdict.slots = trace.names[index]
    return verdict


DETAIL = {
    "ActionEnabled": "the spec cannot take {action} here: its guard does not hold",
    "ActionMatches": (
        "the spec can take {action} here, but not as logged (the outcome, offset or victims "
        "differ from every step the spec allows)"
    ),
    "EventExplained": (
        "the spec can take {action} here, but its post-state differs from the entry the code "
        "logged: {logged}"
    ),
    "Deadlock": "no step of the spec explains this event",
}


def _diagnose(workdir: Path, trace: Converted, verdict: Verdict) -> None:
    """Rerun one rejected trace with the diagnostic invariants: which part of the step failed."""
    if verdict.why not in ("Deadlock",):
        if verdict.why in INVARIANTS:
            verdict.detail = f"this event leads to a state that violates {verdict.why}"
        return
    _, why, _, _, state = _run_batch(workdir, [trace], INVARIANTS + DIAGNOSTICS, 1, "Diag")
    ev = verdict.event or {}
    logged = {f: ev[f] for f in ("state", "offset", "size", "holders", "waiters", "doomed",
                                 "tainted") if f in ev}  # fmt: skip
    template = DETAIL.get(why, DETAIL["Deadlock"])
    verdict.detail = template.format(action=ev.get("action"), logged=logged)
    if state and why in DIAGNOSTICS:
        verdict.why = why
    if why == "EventExplained" and verdict.index is not None:
        # Take the step without its post-state check: the spec's post-state of the entry.
        lax = dataclasses.replace(trace, events=[dict(e) for e in trace.events])
        lax.events[verdict.index]["x"] = True
        _, why, _, _, after = _run_batch(workdir, [lax], ["BeforeLaxEvent"], 1, "Lax")
        key = ev.get("key")
        if why == "BeforeLaxEvent" and after and key:
            spec = {
                path.split(".", 1)[1]: _check_module().render(value)
                for path, value in after.items()
                if path.startswith(f"entry[{key}].")
            }
            shown = ", ".join(f"{field}={value}" for field, value in spec.items())
            verdict.detail += f"\n  the spec's post-state: {shown}"


def validate(
    paths: list[Path] | None = None,
    traces: list[tuple[str, list[dict[str, Any]]]] | None = None,
    workers: int = 2,
    batch_events: int = 200_000,
    keep: Path | None = None,
) -> list[Verdict]:
    """Check traces (files, or (name, events) pairs) against the spec; one Verdict each."""
    loaded = list(traces or [])
    for path in paths or []:
        with open(path, encoding="utf-8") as source:
            loaded.append((str(path), [json.loads(line) for line in source if line.strip()]))
    verdicts: dict[str, Verdict] = {}
    pending: list[Converted] = []
    for name, events in loaded:
        try:
            pending.append(convert(events, name))
        except (TraceError, KeyError, ValueError, TypeError) as error:
            verdicts[name] = Verdict(name, False, len(events), "error", detail=str(error))
    with tempfile.TemporaryDirectory(prefix="embcache-trace-") as tmp:
        workdir = Path(keep) if keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for spec in (SPEC, TRACE_SPEC):
            shutil.copy(HERE / spec, workdir / spec)
        batches: list[list[Converted]] = []
        for trace in pending:
            if not batches or sum(len(t.events) for t in batches[-1]) >= batch_events:
                batches.append([])
            batches[-1].append(trace)
        for number, batch in enumerate(batches):
            while batch:
                ok, why, output, rejected, state = _run_batch(
                    workdir, batch, INVARIANTS, workers, str(number)
                )
                if ok:
                    for trace in batch:
                        verdicts[trace.name] = Verdict(trace.name, True, len(trace.events))
                    break
                if rejected is None or state is None:
                    for trace in batch:
                        verdicts[trace.name] = Verdict(
                            trace.name, False, len(trace.events), "error",
                            detail="TLC failed:\n" + output[-3000:],
                        )  # fmt: skip
                    break
                verdict = _verdict(rejected, why, state)
                _diagnose(workdir, rejected, verdict)
                verdicts[rejected.name] = verdict
                batch = [tr for tr in batch if tr is not rejected]
    return [verdicts[name] for name, _ in loaded]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument("--workers", type=int, default=2, help="TLC workers (default 2)")
    parser.add_argument("--verbose", action="store_true", help="list accepted traces too")
    args = parser.parse_args(argv)
    return report(args.files, args.workers, args.verbose)


def report(files: list[Path], workers: int = 2, verbose: bool = False) -> int:
    """Validate the files, print the verdicts; 0 iff every trace is accepted."""
    started = time.monotonic()
    try:
        verdicts = validate(files, workers=workers)
    except _check_module().CheckError as error:
        print(f"trace: {error}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - started
    rejected = [v for v in verdicts if not v.accepted]
    for verdict in verdicts:
        if verdict.accepted and not verbose:
            continue
        print(verdict.describe())
    events = sum(v.events for v in verdicts)
    print(
        f"{len(verdicts) - len(rejected)} accepted, {len(rejected)} rejected "
        f"({len(verdicts)} traces, {events} events, {seconds:.0f}s, "
        f"{len(verdicts) / max(seconds, 1e-9) * 60:.0f} traces/minute)"
    )
    return 1 if rejected else 0


if __name__ == "__main__":
    sys.exit(main())
