"""Run every embcache benchmark in one process and print one table.

    python -m benchmarks.run [--quick] [--json OUT] [--plots DIR] [--markdown OUT] [--only N ...]
    python -m benchmarks.run --list
    python -m benchmarks.run --calls CALLS.json

``--calls`` runs several benchmark command lines, one after another, in this one process (the
tests' way of paying for torch's import once): CALLS.json is a list of ``{"argv": [MODULE,
ARG, ...], "env": {NAME: VALUE}, "out": DIR}``; each runs as ``python -m MODULE ARG ...`` would
(``runpy``, with those variables set), its stdout, stderr and exit status going to DIR's
``stdout``, ``stderr`` and ``status`` files.

Each benchmark measures ours and a baseline side by side in the same run and reports the ratio,
because these machines are noisy: no row compares against an absolute time. The items are
those of the benchmark issue:

1. allocator: allocate+free pair vs live blocks, against naive first fit and a minimal best fit
2. eviction: an allocation that needs eviction, half the oldest entries pinned, against a
   recency list scanned from the head and SGLang's paged controller
3. hit path: lookup+pin+view+release per item, against a dict lookup + OrderedDict move
   (context), and the serving sequence and get + release against both peers' controllers
4. copy: reading 4 MB and 64 MB items out of the pool, against a raw torch copy; the fixed
   cost of a one-item hit before its copy
5. fragmentation: the realistic mix against first fit with plain LRU and a paged pool; time
   per request against SGLang's paged controller on a 4 MiB pool and a 1 GiB pool
6. metadata: bytes per entry at 100k entries (tracemalloc), against both peers' controllers
7. mooncake: loads through the cache against raw ``batch_get_into`` (needs ``mooncake_master``
   on PATH, else the row says skipped)
8. concurrency: requests/s of the demo workload with 1, 2, 4 and 8 client threads
9. eviction policy: encoder tokens saved per policy and request mix, against every baseline

The peers are SGLang 0.5.23's paged controller, run from its wheel at benchmark time
(``tests/support/sglang_wheel.py``; its rows say skipped when the wheel cannot be had), and the
original PR's controller (``tests/support/baselines.py``); see ``benchmarks/peers/bench_peers.py``.

A row is ``{name, ours, baseline, unit, ratio, target, met}`` (``tests/support/rows.py``, which
checks it); ``met`` is None where there is no
target (or the row was skipped). The ratio reads as its target does: a speedup (baseline /
ours) for times against a baseline or a peer (below 1: ours is slower), a slowdown (ours /
baseline) for the hit path against a bare dict, ours / baseline for bandwidths, bytes and
counts. Progress goes to stderr. The exit status is 1 if a
benchmark raised (its row says so), else 0, whatever the numbers: a missed target is a result.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import runpy
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Section, skipped_row
from tests.support.rows import check_row, json_row

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- the items
def _allocator(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_allocator

    return bench_allocator.run(quick)


def _eviction(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_eviction

    return bench_eviction.run(quick)


def _hitpath(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_hitpath
    from benchmarks.peers import bench_peers

    return bench_hitpath.run(quick) + bench_peers.hit_rows(quick)


def _copy(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_copy

    return bench_copy.run(quick) + bench_copy.fixed_cost_rows(quick)


def _fragmentation(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_fragmentation, bench_paged
    from benchmarks.peers import bench_peers

    rows = bench_fragmentation.run(quick)
    for row in rows:  # the target, where the benchmark states none
        if row["name"].startswith("hit ratio, ") and not row["target"]:
            row["target"] = ">= baseline"
            row["met"] = row["ours"] >= row["baseline"]
    return (
        rows
        + bench_paged.run(quick, rows)
        + bench_peers.replay_rows(quick, real=False)
        + bench_peers.replay_rows(quick, real=True)
    )


def _metadata(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_metadata
    from benchmarks.peers import bench_peers

    rows = bench_metadata.run(quick)
    return rows + bench_peers.metadata_rows(quick, rows[0]["ours"])


def _mooncake(quick: bool) -> list[Row]:
    why = None
    if shutil.which("mooncake_master") is None:
        why = "mooncake_master not on PATH"
    else:
        try:
            from benchmarks.micro import bench_mooncake
        except ImportError as exc:  # the mooncake extra, or pytest (its master helper)
            why = f"cannot import: {exc}"
    if why is not None:
        return [skipped_row("mooncake load vs raw batch_get_into", why, ">= 0.9x raw")]
    return bench_mooncake.run(quick)


def _concurrency(quick: bool) -> list[Row]:
    from benchmarks.micro import bench_concurrency

    return bench_concurrency.run(quick)


def _policy(quick: bool) -> list[Row]:
    from benchmarks.policy import bench_policy, bench_policy_grid

    return bench_policy.run(quick) + bench_policy_grid.run(quick)


ITEMS: list[tuple[int, str, Callable[[bool], list[Row]]]] = [
    (1, "allocator", _allocator),
    (2, "eviction", _eviction),
    (3, "hit path", _hitpath),
    (4, "copy", _copy),
    (5, "fragmentation", _fragmentation),
    (6, "metadata", _metadata),
    (7, "mooncake", _mooncake),
    (8, "concurrency", _concurrency),
    (9, "eviction policy", _policy),
]


# ---------------------------------------------------------------------------- rows
def _num(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    magnitude = abs(value)
    if magnitude == 0 or 0.01 <= magnitude < 1e6:
        return f"{value:.3g}" if magnitude < 10 else f"{value:.1f}"
    return f"{value:.2e}"


def _met(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: ""}[met]


def table(sections: list[Section]) -> str:
    """The results as one plain-text table."""
    head = f"{'#':>2} {'benchmark':58} {'ours':>9} {'baseline':>9} {'unit':>8} {'ratio':>8}  target"
    lines = [head, "-" * len(head)]
    for s in sections:
        for row in s.rows:
            lines.append(
                f"{s.number:>2} {row['name'][:58]:58} {_num(row['ours']):>9} "
                f"{_num(row['baseline']):>9} {row['unit']:>8} {_num(row['ratio']):>8}  "
                f"{row['target']} {_met(row['met'])}".rstrip()
            )
    return "\n".join(lines)


def markdown(
    sections: list[Section],
    machine: dict[str, str],
    quick: bool,
    total: float,
    plots: Sequence[str] = (),
) -> str:
    """RESULTS.md: machine, date, the table, and what is missed."""
    out = [
        "# embcache benchmark results",
        "",
        "Generated by `python -m benchmarks.run"
        + (" --quick" if quick else "")
        + (" --plots benchmarks/plots" if plots else "")
        + " --markdown benchmarks/RESULTS.md`; do not edit by hand. Every row measures ours and "
        "a baseline side by side in the same run (this machine is shared and noisy, so only the "
        "ratios mean anything). The ratio reads as its target does: a speedup (baseline / ours) "
        "for times against a baseline or a peer (below 1: ours is slower), a slowdown (ours / "
        "baseline) for the hit path against a bare dict, ours / baseline for bandwidths, bytes, "
        "counts and percentages. What each benchmark does and "
        "why is in the docstring of its `benchmarks/*/bench_*.py`. Instruction counts against "
        "SGLang's controller (callgrind: repeatable where a time is not) are recorded in "
        "[INSTRUCTIONS.md](INSTRUCTIONS.md) (`benchmarks/peers/bench_instructions.py`).",
        "",
        "## Machine",
        "",
    ]
    out += [f"- {key}: {value}" for key, value in machine.items()]
    out += [f"- suite wall time: {total:.0f} s" + (" (--quick)" if quick else ""), ""]
    out += [
        "## Results",
        "",
        "| # | benchmark | ours | baseline | unit | ratio | target | met |",
        "|---|---|---:|---:|---|---:|---|---|",
    ]
    for s in sections:
        for row in s.rows:
            met = {True: "met", False: "**MISSED**", None: ""}[row["met"]]
            out.append(
                f"| {s.number} | {row['name']} | {_num(row['ours'])} | {_num(row['baseline'])} "
                f"| {row['unit']} | {_num(row['ratio'])} | {row['target']} | {met} |"
            )
    missed = [(s.number, r) for s in sections for r in s.rows if r["met"] is False]
    errors = [s for s in sections if s.error]
    out += ["", "## Missed targets", ""]
    out += [f"- item {n}: {r['name']} ({r['target']})" for n, r in missed] or ["- none"]
    if errors:
        out += ["", "## Errors", ""]
        out += [f"- item {s.number} ({s.title}): {s.error}" for s in errors]
    if plots:
        out += ["", "## Plots", ""]
        out += [f"![{Path(p).stem}]({p})" for p in plots]
    out += ["", "## Time per item", ""]
    out += [f"- {s.number} {s.title}: {s.seconds:.1f} s" for s in sections]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- the machine
def _date() -> str:
    try:
        return subprocess.run(["date"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return datetime.datetime.now().astimezone().strftime("%a %b %d %H:%M:%S %Z %Y")


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB memory"
    except (OSError, ValueError, IndexError):
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = "load average %.1f %.1f %.1f at start" % os.getloadavg()  # noqa: UP031
    cuda = f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no CUDA device"
    info = {
        "date": _date(),
        "cpu": f"{cpu}, {os.cpu_count()} logical cores{memory}",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": f"{torch.__version__}, intra-op threads {torch.get_num_threads()}, {cuda}",
    }
    if load:
        info["load"] = load
    if os.environ.get("EMBCACHE_LOCK_CHECK", "") not in ("", "0"):
        info["lock checking"] = (
            "ON (EMBCACHE_LOCK_CHECK): ours is slowed, numbers not representative"
        )
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        if commit:
            info["commit"] = commit
    except OSError:
        pass
    return info


# ---------------------------------------------------------------------------- running
def run_items(
    quick: bool, only: set[int] | None = None, log: Callable[[str], None] | None = None
) -> list[Section]:
    """Run the items (all, or those in ``only``); a benchmark that raises gives an error row."""
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    chosen = [item for item in ITEMS if only is None or item[0] in only]
    sections = []
    for i, (number, title, bench) in enumerate(chosen, 1):
        say(f"[{i}/{len(chosen)}] {number}. {title} ...")
        section = Section(number, title)
        started = time.perf_counter()
        try:
            rows = bench(quick)
            for row in rows:
                check_row(row)
            section.rows = rows
        except Exception as exc:
            section.error = f"{type(exc).__name__}: {exc}"
            say(traceback.format_exc())
            section.rows = [
                {
                    "name": f"{title}: ERROR {type(exc).__name__}",
                    "ours": None,
                    "baseline": None,
                    "unit": "",
                    "ratio": None,
                    "target": "runs",
                    "met": False,
                }
            ]
        section.seconds = time.perf_counter() - started
        missed = sum(r["met"] is False for r in section.rows)
        say(
            f"[{i}/{len(chosen)}] {number}. {title}: {len(section.rows)} rows, "
            f"{missed} missed, {section.seconds:.1f} s"
        )
        sections.append(section)
    return sections


@contextlib.contextmanager
def _redirected(out: Path, env: dict[str, str]) -> Iterator[None]:
    """File descriptors 1 and 2 to ``out/stdout`` and ``out/stderr`` (a child process's and C
    code's output included), with ``env`` set; all put back after."""
    saved_env = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    try:
        with open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr:
            os.dup2(stdout.fileno(), 1)
            os.dup2(stderr.fileno(), 2)
            os.environ.update(env)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(saved_env)


def _call(argv: list[str]) -> int:
    """``python -m argv[0] argv[1:]`` in this process; its exit status, as Python's would be."""
    saved_argv = sys.argv
    sys.argv = list(argv)  # runpy sets argv[0] to the module's file, as ``-m`` does
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # as the interpreter would: the traceback, status 1
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
    return 0


def run_calls(path: Path) -> int:
    """Each command line of ``path`` (``--calls``) in turn; 0, whatever their exit statuses."""
    for call in json.loads(path.read_text()):
        out = Path(call["out"])
        out.mkdir(parents=True, exist_ok=True)
        with _redirected(out, dict(call.get("env", {}))):
            status = _call([str(arg) for arg in call["argv"]])
        (out / "status").write_text(f"{status}\n")
        print(f"{' '.join(call['argv'])}: exit status {status}", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the embcache benchmarks (ours vs a baseline, side by side)."
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (CI: about a minute)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the rows as a JSON list")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots (matplotlib)")
    parser.add_argument("--markdown", type=Path, metavar="OUT", help="write RESULTS.md")
    parser.add_argument(
        "--only",
        type=int,
        nargs="+",
        metavar="N",
        choices=range(1, len(ITEMS) + 1),
        help=f"run only these items (1-{len(ITEMS)})",
    )
    parser.add_argument("--list", action="store_true", help="print the items (N title) and exit")
    parser.add_argument(
        "--calls",
        type=Path,
        metavar="FILE",
        help="run the benchmark command lines of FILE (JSON) in this process, each as "
        "python -m would, and exit (see the module's docstring)",
    )
    args = parser.parse_args(argv)
    if args.calls is not None:
        return run_calls(args.calls)
    if args.list:
        for number, title, _ in ITEMS:
            print(f"{number} {title}")
        return 0
    if args.plots is not None:
        from benchmarks import plots

        plots.require_matplotlib()  # fail before an hour of benchmarks, not after
    info = machine()
    if "lock checking" in info:
        print(f"warning: lock checking {info['lock checking']}", file=sys.stderr)
    started = time.perf_counter()
    sections = run_items(args.quick, set(args.only) if args.only else None)
    total = time.perf_counter() - started
    if hasattr(os, "getloadavg"):
        info["load"] += ", %.1f %.1f %.1f at end" % os.getloadavg()  # noqa: UP031
    print(table(sections))
    print(f"\n{sum(len(s.rows) for s in sections)} rows in {total:.1f} s", file=sys.stderr)
    rows = [row for s in sections for row in s.rows]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([json_row(r) for r in rows], indent=1) + "\n")
    drawn: list[Path] = []
    if args.plots is not None:
        from benchmarks import plots

        drawn = plots.write_plots(sections, args.plots)
        for path in drawn:
            print(f"plot: {path}", file=sys.stderr)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        links = [
            os.path.relpath(path.resolve(), args.markdown.parent.resolve()).replace(os.sep, "/")
            for path in drawn
        ]
        args.markdown.write_text(markdown(sections, info, args.quick, total, links))
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
