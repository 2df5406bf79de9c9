"""Which policy ``EmbeddingCache`` takes by default: issue 57's rule, measured.

The rule: over every cell below, two seeds each, the default is the policy with the highest
mean encoder work saved among those that never lose more than ``MAX_LOSS`` (1.5) points to
``lru`` on any cell; a tie goes to the cheaper hit path. Encoder work is token-equivalents (a
miss of an image costs its tokens, as the simulation tells ``adaptive-work``), so work saved is
tokens saved, and it is deterministic for a given ``PYTHONHASHSEED`` (the frequency sketch's
collisions follow str hashes): the machine's load does not move it.

Cells (``cells``):
- the grid of ``bench_policy_grid`` (both pools x drift every 100 to 2000 requests x skews 0.6
  to 1.2, steady, scan; seeds 1 and 2, 4000 requests), simulated (``bench_policy.simulate``);
- issue 57's five mixes on both pools (``FIVE``: steady, scan, drift every 500 requests at skew
  0.9, every 150 at 1.1, every 1500 at 0.7; seeds 3 and 4, 6000 requests), simulated;
- the encode server's three mixes (``benchmarks.server``: steady, drifting, scan at full size,
  2000 requests; seeds 0 and 1), replayed one request at a time through the real
  ``EmbeddingCache`` as ``benchmarks.server.replay`` does, each miss's work its tokens, every
  request counted (no warm-up left out, as in the grid).

Each cell also runs the two offline rules of the grid (Belady on bytes, Belady weighed by tokens
per byte); a policy's distance to the optimum is the better of them minus its work saved. The
hit path's cost: instructions per item of an 8-item all-hit request over 1,000 entries
(callgrind, ``bench_instructions``'s request; skipped without valgrind) and its thread time
against ``lru``'s (``bench_policy.hit_request_row``, quick; the ratio of adjacent chunks).

Run from the repository root (about 30 to 60 minutes on a shared 2-core machine):
PYTHONHASHSEED=0 python -m benchmarks.policy.choose_default [--jobs N] [--out DIR] [--tiny]
writes ``DIR/default_policy.json`` and ``.md`` (``DIR``: ``benchmarks/policy/results``);
``--tiny`` is a smoke run (a corner of the grid, one seed, no server mixes, no hit-path cost).
``tests/test_default_policy.py`` checks that ``EmbeddingCache``'s default is the policy the
committed JSON names.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.policy import bench_policy_grid as grid
from benchmarks.policy.bench_policy import hit_request_row, simulate
from benchmarks.policy.cheap_shadows import HalfShadows
from benchmarks.policy.work_noise import NoisyWork
from embcache.core.policy import Policy, make_policy
from tests.support import mixes

NOISE = 2.0  # adaptive-work-noisy: each encoding's work told x a factor in [1/NOISE, NOISE]


def _noisy_work() -> Policy:
    return NoisyWork(NOISE, 0)


VARIANTS: dict[str, Callable[[], Policy]] = {  # measured, not product policies
    "adaptive-half": HalfShadows,  # cheaper shadows (issue 57, point 4)
    "adaptive-work-noisy": _noisy_work,  # adaptive-work told work as a loaded clock measures it
}
PRODUCT = ("lru", "tinylfu", "adaptive", "adaptive-work")  # the policies a default can be
POLICIES = (*PRODUCT, *VARIANTS)
SAME_HIT = {"adaptive-work-noisy": "adaptive-work"}  # the same hit path: not counted twice
BASE = "lru"
MAX_LOSS = 1.5  # points of work saved a default may lose to lru on any cell
OFFLINE = (grid.OPTIMUM, grid.OPTIMUM_COST)
FIVE = (("steady", 0.9, None), ("scan", 0.9, None), ("drift", 0.9, 500), ("drift", 1.1, 150),
        ("drift", 0.7, 1500))  # fmt: skip
SERVER_MIXES = ("steady", "drifting", "scan")
SERVER_SEEDS = (0, 1)
SERVER_REQUESTS = 2000
HIT_ENTRIES = 1000
RESULTS = Path(__file__).resolve().parent / "results"
JSON_NAME = "default_policy.json"


@dataclass(frozen=True)
class Run:
    """One seed of one cell: a simulated grid or five-mix cell, or a server mix."""

    family: str  # "grid", "five" or "server"
    label: str
    seed: int
    cell: grid.Cell | None = None  # simulated cells
    requests: int = 0


def five_cells() -> list[grid.Cell]:
    """Issue 57's five mixes on each pool."""
    return [grid.Cell(pool, mix, skew, period) for pool in grid.POOLS for mix, skew, period in FIVE]


def runs(tiny: bool) -> list[Run]:
    """Every run of the rule (``tiny``: the tiny grid, one seed, nothing else)."""
    cells, requests, seeds = grid.runs_of(tiny, False)
    out = [Run("grid", c.label, s, c, requests) for c in cells for s in seeds]
    if tiny:
        return out
    out += [Run("five", c.label, s, c, grid.FIVE_REQUESTS) for c in five_cells()
            for s in grid.FIVE_SEEDS]  # fmt: skip
    out += [Run("server", f"server {m}", s) for m in SERVER_MIXES for s in SERVER_SEEDS]
    return out


# ---------------------------------------------------------------------------- one run
def policy_of(name: str) -> Policy:
    """A new policy called ``name``: a product policy, or one of ``VARIANTS``."""
    made = VARIANTS.get(name)
    return make_policy(name) if made is None else made()


def run_simulated(run: Run) -> dict[str, float]:
    """Work saved (%) by every policy and offline rule on one seed of a simulated cell."""
    assert run.cell is not None
    load = grid.workload(run.cell, run.seed, run.requests)
    capacity = run.cell.pool.capacity
    out = {name: simulate(load, policy_of(name), capacity=capacity).tokens_saved
           for name in POLICIES}  # fmt: skip
    out[grid.OPTIMUM] = mixes.optimum(load, capacity).tokens_saved
    out[grid.OPTIMUM_COST] = grid.optimum_cost(load, capacity).tokens_saved
    return out


@dataclass(frozen=True)
class _ServerSpec:
    """A server image as the offline rules read it."""

    key: str
    tokens: int
    nbytes: int


def run_server(run: Run) -> dict[str, float]:
    """Work saved (%) by every policy (the real cache, ``replay.replay_embcache``, each miss's
    work its tokens) and offline rule on one seed of a server mix, every request counted."""
    import torch

    from benchmarks.server import replay
    from benchmarks.server.workload import SIZES
    from tests.support.server_workload import TOKENS, make_encoder, make_workload

    mix = run.label.removeprefix("server ")
    config = replace(SIZES["full"], seed=run.seed, requests=SERVER_REQUESTS)
    torch.set_num_threads(1)
    workload = make_workload(  # every mix, in bench_server's order (as replay.run)
        make_encoder(config.hidden), config.hot, config.requests, config.zipf_s, config.seed,
        config.mixes,
    )  # fmt: skip
    pool_bytes = int(config.pool_fraction * workload.hot_bytes()) // 4096 * 4096
    trace = workload.mixes[mix]
    requested = sum(image.tokens for images in trace for image in images)
    work = {tokens: float(tokens) for tokens in TOKENS}
    out = {}
    for name in POLICIES:
        contender = f"{name} (own cost)" if name.startswith("adaptive-work") else name
        made = policy_of(name) if name in VARIANTS else None
        tally = replay.replay_embcache(trace, 0, pool_bytes, work, contender, made)
        out[name] = 100 * tally.tokens_saved / requested
    index: dict[str, int] = {}
    specs: list[_ServerSpec] = []
    requests = []
    for images in trace:
        request = []
        for image in images:
            if image.key not in index:
                index[image.key] = len(specs)
                specs.append(_ServerSpec(image.key, image.tokens, image.nbytes))
            if index[image.key] not in request:
                request.append(index[image.key])
        requests.append(request)
    load = mixes.Workload(specs, requests, 0)  # type: ignore[arg-type]
    # a key twice in one request is one encode, as replay counts it: the offline rules count
    # its tokens once too, so their shares are of the same requested tokens as the policies'
    offline_requested = sum(specs[i].tokens for request in requests for i in request)
    for name, rule in ((grid.OPTIMUM, mixes.optimum), (grid.OPTIMUM_COST, grid.optimum_cost)):
        result = rule(load, pool_bytes)
        out[name] = 100 * (result.hit_tokens + requested - offline_requested) / requested
    return out


def run_one(run: Run) -> dict[str, float]:
    return run_server(run) if run.family == "server" else run_simulated(run)


def measure(all_runs: Sequence[Run], jobs: int) -> dict[Run, dict[str, float]]:
    """Every run, shared out to ``jobs`` processes (progress on stderr)."""
    out: dict[Run, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(jobs))
        futures = {pool.submit(run_one, r): r for r in all_runs}
        for done, future in enumerate(as_completed(futures), 1):
            out[futures[future]] = future.result()
            print(f"{done}/{len(futures)} {futures[future].label} seed {futures[future].seed}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return out


# ---------------------------------------------------------------------------- hit path
def hit_instructions(policy: str) -> float:
    """Instructions per item of the 8-item all-hit request over ``HIT_ENTRIES`` entries with
    ``policy`` (callgrind, ``bench_instructions``'s request and regions; main thread only).

    raises: tests.support.callgrind.Unavailable without valgrind or when the run fails"""
    from benchmarks.peers import bench_instructions as bi
    from tests.support.callgrind import Unavailable, per_operation, total

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise Unavailable("valgrind not on PATH")
    low, high = 10, 110
    with tempfile.TemporaryDirectory(prefix="embcache-callgrind-") as folder:
        command = [
            valgrind, "--tool=callgrind", "--collect-atstart=no", "--separate-threads=yes",
            f"--callgrind-out-file={folder}/cg.%p", sys.executable, "-m",
            "benchmarks.policy.choose_default", "--hit-child", policy,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, cwd=bi.ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"the counted run failed ({done.returncode}): {done.stderr[-300:]}")
        dumps = sorted(Path(folder).glob("cg.*.*-01"),
                       key=lambda p: int(p.name.split(".")[-1].split("-")[0]))  # fmt: skip
        counts = [total(path) for path in dumps]
    return per_operation(["hit", "hit"], counts, high - low)["hit"] / bi.BATCH


def hit_child(policy: str) -> None:
    """Under callgrind: ``bench_instructions``' all-hit request with ``policy``; a warm-up that
    looks every key up once (the shadows then hold every key, as in a steady state) and
    ``WARMUP`` random requests; then 10 requests (dump), 100 (dump)."""
    from benchmarks.peers import bench_instructions as bi

    rng = random.Random(HIT_ENTRIES)
    keys = [f"img{i}" for i in range(HIT_ENTRIES)]
    rng.shuffle(keys)
    warm = HIT_ENTRIES // bi.BATCH + bi.WARMUP  # every key once, then random requests
    batches = [keys[n * bi.BATCH : (n + 1) * bi.BATCH] for n in range(HIT_ENTRIES // bi.BATCH)]
    batches += [rng.sample(keys, bi.BATCH) for _ in range(bi.WARMUP + 110)]
    op, check = bi.ours_hit(HIT_ENTRIES, batches, policy=policy_of(policy))
    for n in range(warm):
        op(n)
    start = warm
    for count in (10, 100):
        gc.collect()
        bi.toggle()
        for n in range(start, start + count):
            op(n)
        bi.toggle_and_dump()
        start += count
    check(start)


def hit_costs(policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per policy: instructions per hit item (None and why, without valgrind), their ratio to
    ``lru``'s, and the all-hit request's time per item against ``lru``'s."""
    from tests.support.callgrind import Unavailable

    out: dict[str, dict[str, Any]] = {}
    for name in policies:
        if name in SAME_HIT:
            continue
        try:
            out[name] = {"instructions": hit_instructions(name)}
        except Unavailable as why:
            out[name] = {"instructions": None, "why": str(why)}
        made = policy_of(name) if name in VARIANTS else None
        row = hit_request_row(True, HIT_ENTRIES, name, made)
        out[name] |= {"us_per_item": row["ours"], "time_vs_lru": row["ratio"]}
    for name, same in SAME_HIT.items():
        if name in policies:
            out[name] = dict(out[same])
    base = out[BASE]["instructions"]
    for cost in out.values():
        mine = cost["instructions"]
        cost["instructions_vs_lru"] = mine / base if mine is not None and base else None
    return out


# ---------------------------------------------------------------------------- the rule
def summarize(results: dict[Run, dict[str, float]]) -> list[dict[str, Any]]:
    """Each cell's means over its seeds, in the runs' order."""
    cells: dict[tuple[str, str], list[dict[str, float]]] = {}
    seeds: dict[tuple[str, str], list[int]] = {}
    for run in sorted(results, key=lambda r: (r.family, r.label, r.seed)):
        cells.setdefault((run.family, run.label), []).append(results[run])
        seeds.setdefault((run.family, run.label), []).append(run.seed)
    return [
        {
            "family": family,
            "label": label,
            "seeds": seeds[family, label],
            "saved": {k: statistics.fmean(r[k] for r in got) for k in got[0]},
            "per_seed": got,
        }
        for (family, label), got in cells.items()
    ]


def candidates(cells: Sequence[dict[str, Any]], policies: Sequence[str]) -> dict[str, Any]:
    """Per policy: mean work saved, its worst cell against ``lru``, its mean and worst distance
    to the better offline rule."""
    out = {}
    for name in policies:
        against = [(c["saved"][name] - c["saved"][BASE], c["label"]) for c in cells]
        distance = [max(c["saved"][o] for o in OFFLINE) - c["saved"][name] for c in cells]
        worst = min(against)
        out[name] = {
            "mean_saved": statistics.fmean(c["saved"][name] for c in cells),
            "worst_vs_lru": worst[0],
            "worst_cell": worst[1],
            "cells_below_lru": sum(d < 0 for d, _ in against),
            "mean_to_optimum": statistics.fmean(distance),
            "max_to_optimum": max(distance),
            "eligible": worst[0] >= -MAX_LOSS,
        }
    return out


def choose(table: dict[str, Any], costs: dict[str, dict[str, Any]] | None) -> str:
    """The rule: the highest mean work saved among the eligible policies of the product
    (``PRODUCT``; ``lru`` is always eligible; a variant that would win is reported, and must
    become a product policy first); a tie (equal to the hundredth of a point) goes to the
    fewer instructions per hit item, else the shorter time."""

    def cost(name: str) -> float:
        if not costs or name not in costs:
            return 0.0
        count = costs[name].get("instructions")
        return count if count is not None else costs[name].get("us_per_item", 0.0)

    eligible = [n for n, v in table.items() if v["eligible"] and n in PRODUCT]
    return min(eligible, key=lambda n: (-round(table[n]["mean_saved"], 2), cost(n)))


# ---------------------------------------------------------------------------- report
def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    return done.stdout.strip() or "unknown"


def markdown(report: dict[str, Any]) -> str:
    """The report as a page: the candidates' table, then every cell."""
    table, costs = report["candidates"], report["hit_path"]
    lines = [
        "# The default policy, by issue 57's rule",
        "",
        "Generated by `PYTHONHASHSEED=0 python -m benchmarks.policy.choose_default`; do not edit "
        "by hand.",
        f"Commit `{report['commit']}`, {report['date']}, PYTHONHASHSEED="
        f"{report['hash_seed']}, {report['seconds']:.0f} s wall ({report['jobs']} processes, "
        "shared machine). Seeds: grid "
        + ", ".join(map(str, report["seeds"]["grid"]))
        + "; five mixes "
        + ", ".join(map(str, report["seeds"]["five"]))
        + "; server "
        + ", ".join(map(str, report["seeds"]["server"]))
        + ".",
        f"{len(report['cells'])} cells. Work saved: % of requested encoder work (tokens), "
        f"means over the seeds. Rule: the highest mean among the policies never more than "
        f"{MAX_LOSS:g} points below `lru` on a cell; ties to the cheaper hit path.",
        "",
        f"**Default: `{report['default']}`.**",
        "",
        "| policy | mean saved | worst cell vs lru | cells below lru | eligible | to optimum, "
        "mean (max) | hit instructions / item (vs lru) | hit time / item (vs lru) |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for name, v in table.items():
        cost = costs.get(name, {})
        count = cost.get("instructions")
        count_text = (f"{count:,.0f} ({cost['instructions_vs_lru']:.3f}x)"
                      if count is not None else "n/a")  # fmt: skip
        time_text = (f"{cost['us_per_item']:.2f} us ({cost['time_vs_lru']:.2f}x)"
                     if "us_per_item" in cost else "n/a")  # fmt: skip
        lines.append(
            f"| `{name}` | {v['mean_saved']:.2f} | {v['worst_vs_lru']:+.2f} ({v['worst_cell']}) "
            f"| {v['cells_below_lru']} | {'yes' if v['eligible'] else 'no'} | "
            f"{v['mean_to_optimum']:.2f} ({v['max_to_optimum']:.2f}) | {count_text} | "
            f"{time_text} |"
        )
    names = [*report["policies"], *OFFLINE]
    lines += ["", "| cell | seeds | " + " | ".join(names) + " |",
              "|---|---|" + "---:|" * len(names)]  # fmt: skip
    for cell in report["cells"]:
        lines.append(
            f"| {cell['family']}: {cell['label']} | {', '.join(map(str, cell['seeds']))} | "
            + " | ".join(f"{cell['saved'][n]:.2f}" for n in names)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="processes running the cells")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON and page")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: the tiny grid only")
    parser.add_argument("--hit-child", metavar="POLICY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hit_child:
        hit_child(args.hit_child)
        return 0
    started = time.perf_counter()
    all_runs = runs(args.tiny)
    results = measure(all_runs, args.jobs)
    cells = summarize(results)
    table = candidates(cells, POLICIES)
    costs = {} if args.tiny else hit_costs(POLICIES)
    report = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hash_seed": os.environ.get("PYTHONHASHSEED", "random"),
        "jobs": args.jobs,
        "seconds": time.perf_counter() - started,
        "seeds": {
            "grid": list(grid.runs_of(args.tiny, False)[2]),
            "five": [] if args.tiny else list(grid.FIVE_SEEDS),
            "server": [] if args.tiny else list(SERVER_SEEDS),
        },
        "rule": {"base": BASE, "max_loss": MAX_LOSS, "tie": "fewer hit instructions per item"},
        "policies": list(POLICIES),
        "default": choose(table, costs),
        "candidates": table,
        "hit_path": costs,
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "default_policy_tiny" if args.tiny else JSON_NAME.removesuffix(".json")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    page = markdown(report)
    (args.out / f"{stem}.md").write_text(page, encoding="utf-8")
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
