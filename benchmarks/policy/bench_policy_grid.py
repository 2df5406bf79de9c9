"""Policies on a grid of request mixes: encoder tokens saved against every baseline and the optimum.

Cells: drifting mixes (the popularity ranking reshuffled every 100, 250, 500, 1000 or 2000
requests) x Zipf skews 0.6, 0.8, 1.0 and 1.2, plus ``steady`` (Zipf 0.9, no drift) and ``scan``
(steady, and every third request one new image never seen again), on two pools:
- ``4MiB``: a 4 MiB pool, entries of 64..4096 tokens (log-uniform) x 14 B (the mixed pool of
  ``bench_peers``); the paged baseline has 1 KiB pages;
- ``1GiB``: a 1 GiB pool at real sizes (3584 hidden, 70% bf16, 30% fp32: ``bench_fragmentation``'s
  catalogue); the paged baseline has 256 KiB pages.
Each cell runs ``SEEDS`` seeds (catalogue, requests and reshuffles drawn from the seed) of
``REQUESTS`` requests of 1-3 distinct images over 1500 images, 4 requests held open, as
``bench_policy`` does; a cell's numbers are the means over its seeds.
Contenders: the baselines LRU-to-fit and LRU-to-bytes over first fit
(``bench_fragmentation.run_baseline``) and the paged LRU pool (``bench_paged.run_paged``); our
policies ``lru``, ``tinylfu`` and ``adaptive`` through ``bench_policy.simulate`` (the real
allocator and victim rule under the cache's actions, which ``bench_policy`` checks against the
real cache; no torch, no copies); and ``optimum``: Belady's offline rule on bytes, contiguity
and pins ignored (on a miss, evict the entries needed next furthest in the future, and bypass
the candidate when it is needed later than every entry it would displace). For variable sizes
that rule is a strong heuristic, not a proven bound: it is the ceiling we measure against.
Reported per cell: tokens saved by each, the default policy's margin over the best baseline
(target >= -0.5 point), its distance to the optimum, and on drifting cells the bytes evicted
per byte inserted of ours (``adaptive`` and ``lru``) against the paged pool's (the cost of
contiguity: a contiguous pool evicts a whole window where a paged one evicts pages).
``--tiny`` (the CI smoke test): two drift periods x two skews + steady + scan on the 4 MiB pool,
one seed, 400 requests. ``--variant MODULE:NAME --against JSON`` runs only the policy that
``MODULE:NAME`` makes (a class or a function of no arguments), in place of the default, on the
cells of a stored ``--json`` run of the same ``--tiny`` / ``--five``, and reports its lead over
the stored contenders (the default's stored lead beside): an idea in about a minute on one core
where the whole grid takes a quarter of an hour (same PYTHONHASHSEED as the stored run).
Run from the repository root: python -m benchmarks.policy.bench_policy_grid [--tiny] [--five]
[--plot DIR] [--jobs N] [--markdown OUT] [--json OUT] [--variant MODULE:NAME --against JSON]
(the runs are independent; N processes share them out; ``benchmarks/policy_grid.md`` is its
markdown page).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import make_row, print_rows
from benchmarks.micro import bench_fragmentation as frag
from benchmarks.micro import bench_paged
from benchmarks.policy.bench_policy import from_tally, simulate
from embcache.core.policy import Policy, make_policy
from embcache.errors import InvalidArgumentError
from tests.support import mixes
from tests.support.rows import json_row

PERIODS = (100, 250, 500, 1000, 2000)
SKEWS = (0.6, 0.8, 1.0, 1.2)
STEADY_SKEW = 0.9
SCAN_EVERY = 3
UNIVERSE = 1500
REQUESTS = 4000
SEEDS = (1, 2)
OURS = ("lru", "tinylfu", "adaptive")
DEFAULT = "adaptive"  # the policy the targets are for
PAGED = "paged"
BASELINES = (*frag.BASELINES, PAGED)
OPTIMUM = "optimum"
OPTIMUM_COST = "optimum-cost"
SLACK = 0.5  # points of tokens saved the default may lose to the best baseline on a cell
LRU_MARGIN = 3.0  # points over our LRU on steady and scan
CONTENDER_SLACK = 0.3  # issue 41: the default within this of the best contender on every cell
LEAD = 1.0  # ... and this many points ahead of the best other contender on half of the cells
FIVE_REQUESTS = 6000  # the five mixes: longer runs, seeds the grid never uses
FIVE_SEEDS = (3, 4)


@dataclass(frozen=True)
class Pool:
    """A pool size, the bytes of a token of its entries (None: the real catalogue), its pages."""

    name: str
    capacity: int
    token_bytes: int | None
    page: int


POOLS = (Pool("4MiB", 4 << 20, 14, 1024), Pool("1GiB", 1 << 30, None, bench_paged.PAGE))


@dataclass(frozen=True)
class Cell:
    """One mix on one pool: ``mix`` is ``drift``, ``steady`` or ``scan``."""

    pool: Pool
    mix: str
    skew: float
    period: int | None

    @property
    def label(self) -> str:
        if self.mix == "drift":
            return f"{self.pool.name} drift {self.period} z{self.skew:g}"
        return f"{self.pool.name} {self.mix}"


def five_cells() -> list[Cell]:
    """The five mixes of issue 41 on each pool (steady, scan, drift every 1500 and 500
    requests at skew 0.9, drift every 150 at skew 1.1), run with ``FIVE_SEEDS`` and
    ``FIVE_REQUESTS``: skews, periods, seeds and lengths the grid does not use."""
    out = []
    for pool in POOLS:
        out += [Cell(pool, "steady", STEADY_SKEW, None), Cell(pool, "scan", STEADY_SKEW, None)]
        out += [Cell(pool, "drift", STEADY_SKEW, 1500), Cell(pool, "drift", STEADY_SKEW, 500)]
        out.append(Cell(pool, "drift", 1.1, 150))
    return out


def cells(tiny: bool) -> list[Cell]:
    """The grid: every pool x (drift period x skew, steady, scan); ``tiny`` a corner of it."""
    pools, periods, skews = (POOLS[:1], (100, 500), (0.8, 1.2)) if tiny else (POOLS, PERIODS, SKEWS)
    out = []
    for pool in pools:
        out += [Cell(pool, "drift", s, p) for p in periods for s in skews]
        out += [Cell(pool, "steady", STEADY_SKEW, None), Cell(pool, "scan", STEADY_SKEW, None)]
    return out


def workload(cell: Cell, seed: int, requests: int) -> mixes.Workload:
    """The requests of ``cell`` drawn from ``seed`` (``mixes.zipf_workload``): Zipf(skew) over
    the pool's catalogue, its ranking reshuffled every ``period`` requests (drift), or one new
    image every third request (scan)."""
    scan_every = SCAN_EVERY if cell.mix == "scan" else None
    return mixes.zipf_workload(
        seed, UNIVERSE, requests, cell.skew, cell.period, scan_every, cell.pool.token_bytes
    )


# ---------------------------------------------------------------------------- the optimum
def optimum_cost(load: mixes.Workload, capacity: int) -> mixes.Result:
    """Belady weighed by worth (contiguity and pins ignored): on a miss, evict the entries with
    the most bytes x lookups-until-next-use per token saved by a hit (the furthest-needed,
    biggest, cheapest to recompute first) until the candidate fits, and bypass the candidate
    when its own such priority is above the next victim's. Where a token's bytes vary (the
    1 GiB pool: bf16 and fp32) it differs from ``mixes.optimum``, which weighs every byte
    alike; like it, a heuristic for variable sizes, not a proven bound. O(misses x entries)."""
    lookups, upcoming = mixes.next_uses(load)
    never = len(lookups)
    result = mixes.Result()
    resident: dict[int, int] = {}  # image -> its next lookup
    used = 0

    def priority(index: int, following: int, now: int) -> float:
        spec = load.specs[index]
        if following == never:
            return math.inf
        return (following - now) * mixes.aligned(spec.nbytes) / max(spec.tokens, 1)

    for position, index in enumerate(lookups):
        item = load.specs[index]
        size = mixes.aligned(item.nbytes)
        result.lookups += 1
        result.lookup_tokens += item.tokens
        following = upcoming[position]
        if index in resident:
            result.hits += 1
            result.hit_tokens += item.tokens
            resident[index] = following
            continue
        result.inserts += 1
        if following == never or size > capacity:
            continue
        if used + size > capacity:
            mine = priority(index, following, position)
            ranked = sorted(resident, key=lambda i: -priority(i, resident[i], position))
            victims, freed = [], 0
            for victim in ranked:
                if (
                    used - freed + size <= capacity
                    or priority(victim, resident[victim], position) <= mine
                ):
                    break
                victims.append(victim)
                freed += mixes.aligned(load.specs[victim].nbytes)
            if used - freed + size > capacity:
                result.refused += 1
                continue
            for victim in victims:
                del resident[victim]
                result.evictions += 1
                result.evicted_bytes += mixes.aligned(load.specs[victim].nbytes)
            used -= freed
        resident[index] = following
        used += size
        result.inserted_bytes += size
    return result


# ---------------------------------------------------------------------------- the grid
def run_cell(cell: Cell, seed: int, requests: int) -> dict[str, mixes.Result]:
    """Every contender on one seed of ``cell``."""
    return run_load(workload(cell, seed, requests), cell.pool)


def run_load(load: mixes.Workload, pool: Pool) -> dict[str, mixes.Result]:
    """Every contender on ``load`` in ``pool``."""
    out = {
        mode: from_tally(frag.run_baseline(load, mode, pool.capacity)) for mode in frag.BASELINES
    }
    out[PAGED] = from_tally(bench_paged.run_paged(load, pool.capacity, pool.page))
    for name in OURS:
        out[name] = simulate(load, make_policy(name), capacity=pool.capacity)
    out[OPTIMUM] = mixes.optimum(load, pool.capacity)
    out[OPTIMUM_COST] = optimum_cost(load, pool.capacity)
    return out


@dataclass
class Summary:
    """A cell's means over its seeds: tokens saved and bytes evicted per byte inserted."""

    saved: dict[str, float]
    churn: dict[str, float]

    @property
    def best_baseline(self) -> str:
        return max(BASELINES, key=self.saved.__getitem__)

    def margin(self, name: str = DEFAULT) -> float:
        """Points of tokens saved over the best baseline."""
        return self.saved[name] - self.saved[self.best_baseline]

    def best_other(self, name: str = DEFAULT) -> str:
        """The best contender but ``name`` (every baseline and every policy of ours)."""
        return max((n for n in (*BASELINES, *OURS) if n != name), key=self.saved.__getitem__)

    def lead(self, name: str = DEFAULT) -> float:
        """Points of tokens saved over the best other contender (issue 41's measure)."""
        return self.saved[name] - self.saved[self.best_other(name)]

    @property
    def offline(self) -> float:
        """The better of the two offline rules."""
        return max(self.saved[OPTIMUM], self.saved[OPTIMUM_COST])


def runs_of(tiny: bool, five: bool) -> tuple[list[Cell], int, tuple[int, ...]]:
    """The cells, requests per run and seeds: the grid, its tiny corner or the five mixes."""
    if five:
        return five_cells(), FIVE_REQUESTS, FIVE_SEEDS
    return cells(tiny), *((400, SEEDS[:1]) if tiny else (REQUESTS, SEEDS))


def five_mix_page(
    doc: str,
    run: Callable[[Cell, int, int], dict[Any, float]],
    markdown: Callable[[dict[Cell, dict[Any, float]], float], str],
) -> None:
    """The ``__main__`` of a study on the five mixes: ``run(cell, seed, requests)`` for each
    cell and seed, its numbers averaged over the seeds, rendered by ``markdown(means,
    seconds)``, printed and, with ``--markdown OUT``, written to OUT."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--markdown", type=Path, metavar="OUT", help="write the page to OUT")
    args = parser.parse_args()
    started = time.perf_counter()
    five, requests, seeds = runs_of(False, True)
    means = {}
    for cell in five:
        runs = [run(cell, seed, requests) for seed in seeds]
        means[cell] = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
    page = markdown(means, time.perf_counter() - started)
    if args.markdown is not None:
        args.markdown.write_text(page, encoding="utf-8")
    print(page)


def measure(tiny: bool, jobs: int = 1, five: bool = False) -> dict[Cell, Summary]:
    """The grid's summaries (``five``: the five mixes'), cell by cell, each seed of each cell
    run by one of ``jobs`` processes (a progress bar on stderr)."""
    grid, requests, seeds = runs_of(tiny, five)
    runs: dict[Cell, list[dict[str, mixes.Result]]] = {cell: [] for cell in grid}
    work = [(cell, seed) for cell in grid for seed in seeds]
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=len(work), desc="policy grid", unit="run"))
        if jobs == 1:
            for cell, seed in work:
                bar.set_postfix_str(f"{cell.label} seed {seed}")
                runs[cell].append(run_cell(cell, seed, requests))
                bar.update()
        else:
            pool = stack.enter_context(ProcessPoolExecutor(jobs))
            futures = {pool.submit(run_cell, c, s, requests): c for c, s in work}
            for future in as_completed(futures):
                runs[futures[future]].append(future.result())
                bar.set_postfix_str(futures[future].label)
                bar.update()
    out: dict[Cell, Summary] = {}
    for cell, results in runs.items():
        names = list(results[0])
        out[cell] = Summary(
            {n: statistics.fmean(r[n].tokens_saved for r in results) for n in names},
            {n: statistics.fmean(_churn(r[n]) for r in results) for n in names},
        )
    return out


def _churn(result: mixes.Result) -> float:
    return result.evicted_bytes / result.inserted_bytes if result.inserted_bytes else 0.0


# ---------------------------------------------------------------------------- a variant
def policy_factory(spec: str) -> Callable[[], Policy]:
    """What ``module:name`` names (a policy class, or a function that makes a policy).

    raises: InvalidArgumentError when ``spec`` is not ``module:name`` or names nothing"""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise InvalidArgumentError(f"a variant is module:name, got {spec!r}")
    factory = getattr(importlib.import_module(module), name, None)
    if not callable(factory):
        raise InvalidArgumentError(f"{module} has no callable {name!r} (variant {spec!r})")
    return factory  # type: ignore[no-any-return]


def variant_saved(spec: str, cell: Cell, seed: int, requests: int) -> float:
    """Tokens saved (%) by the policy that ``spec`` makes, on one seed of ``cell``; an oracle
    (a factory whose ``ORACLE`` is true) is made with the workload and the pool's capacity."""
    load = workload(cell, seed, requests)
    factory = policy_factory(spec)
    oracle = getattr(factory, "ORACLE", False)
    policy = factory(load, cell.pool.capacity) if oracle else factory()
    return simulate(load, policy, capacity=cell.pool.capacity).tokens_saved


@dataclass
class VariantCell:
    """A variant on one cell beside a stored run: its tokens saved, its lead over the stored
    contenders but ``DEFAULT`` (which it would replace), and ``DEFAULT``'s stored lead."""

    label: str
    saved: float
    lead: float
    stored_lead: float


def measure_variant(
    spec: str, against: dict[str, Any], tiny: bool, five: bool, jobs: int = 1
) -> list[VariantCell]:
    """Run only the policy ``spec`` makes (``module:name``) on the cells and seeds of a stored
    run (``against``: what ``--json`` wrote for the same ``tiny`` and ``five``), and compare
    it with the stored contenders: an idea for ``DEFAULT`` measured in a minute, not the
    grid's quarter hour (the contenders are deterministic given PYTHONHASHSEED).

    raises: InvalidArgumentError when ``against`` is not a run of these cells"""
    policy_factory(spec)  # a bad spec fails here, not in a child
    grid, requests, seeds = runs_of(tiny, five)
    stored = {row["label"]: row["saved"] for row in against.get("cells", [])}
    if sorted(stored) != sorted(c.label for c in grid):
        raise InvalidArgumentError(
            f"the stored run has cells {sorted(stored)}, these runs {[c.label for c in grid]}: "
            "compare with a --json of the same --tiny / --five"
        )
    work = [(cell, seed) for cell in grid for seed in seeds]
    if jobs == 1:
        saved = [variant_saved(spec, cell, seed, requests) for cell, seed in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            runs = [pool.submit(variant_saved, spec, cell, seed, requests) for cell, seed in work]
            saved = [run.result() for run in runs]
    out = []
    for i, cell in enumerate(grid):
        mine = statistics.fmean(saved[i * len(seeds) : (i + 1) * len(seeds)])
        others = stored[cell.label]
        best = max(others[n] for n in (*BASELINES, *OURS) if n != DEFAULT)
        out.append(VariantCell(cell.label, mine, mine - best, others[DEFAULT] - best))
    return out


def variant_report(spec: str, cells: list[VariantCell]) -> str:
    """One line per cell and a summary against issue 41's bounds, the stored default beside."""
    lines = [f"{'cell':24} {'saved':>6} {'lead':>6} {'stored':>6}"]
    lines += [f"{c.label:24} {c.saved:6.2f} {c.lead:+6.2f} {c.stored_lead:+6.2f}" for c in cells]
    for name, leads in (
        (spec, [c.lead for c in cells]),
        (f"stored {DEFAULT}", [c.stored_lead for c in cells]),
    ):
        worst = min(range(len(cells)), key=leads.__getitem__)
        lines.append(
            f"{name}: {sum(x < -CONTENDER_SLACK for x in leads)} of {len(cells)} cells more "
            f"than {CONTENDER_SLACK:g} point behind, {sum(x >= LEAD for x in leads)} ahead by "
            f"{LEAD:g}, mean lead {statistics.fmean(leads):+.3f}, worst "
            f"{leads[worst]:+.2f} ({cells[worst].label})"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- report
def table(grid: dict[Cell, Summary]) -> str:
    """Tokens saved per cell and contender, the two offline rules beside them; the default's
    margin over the best baseline and lead over the best other contender, its distance to the
    better offline rule; bytes evicted per byte inserted (adaptive, lru, paged)."""
    names = [*BASELINES, *OURS, OPTIMUM, OPTIMUM_COST]
    head = f"{'cell':24}" + "".join(f" {n[:9]:>9}" for n in names)
    head += f" {'margin':>7} {'lead':>6} {'to opt':>7} {'churn a/l/p':>16}"
    lines = [head, "-" * len(head)]
    for cell, s in grid.items():
        line = f"{cell.label:24}" + "".join(f" {s.saved[n]:9.1f}" for n in names)
        line += f" {s.margin():+7.1f} {s.lead():+6.1f} {s.offline - s.saved[DEFAULT]:7.1f}"
        line += f" {s.churn[DEFAULT]:5.2f}/{s.churn['lru']:4.2f}/{s.churn[PAGED]:4.2f}"
        lines.append(line)
    return "\n".join(lines)


def markdown(
    grid: dict[Cell, Summary], seconds: float, jobs: int, tiny: bool, five: bool = False
) -> str:
    """The grid as a markdown page: how it was made, then one line per cell."""
    names = [*BASELINES, *OURS, OPTIMUM, OPTIMUM_COST]
    _, requests, seeds = runs_of(tiny, five)
    missed = [c.label for c, s in grid.items() if s.margin() < -SLACK]
    behind = [
        f"{c.label} ({s.lead():+.1f})" for c, s in grid.items() if s.lead() < -CONTENDER_SLACK
    ]
    ahead = sum(s.lead() >= LEAD for s in grid.values())
    lru_missed = [
        c.label
        for c, s in grid.items()
        if c.mix in ("steady", "scan") and s.saved[DEFAULT] < s.saved["lru"] + LRU_MARGIN
    ]
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    out = [
        "# Policies on the grid",
        "",
        "Generated by `python -m benchmarks.policy.bench_policy_grid"
        + (" --tiny" if tiny else "")
        + (" --five" if five else "")
        + " --markdown OUT --plot DIR`; do not edit by hand.",
        f"{len(grid)} cells x {len(seeds)} seeds ({', '.join(map(str, seeds))}) x {requests} "
        f"requests; {jobs} process(es), "
        f"{seconds:.0f} s wall on a shared machine (load average {load} at the end).",
        f"Run {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU(s) ({platform.machine()}), "
        f"Python {platform.python_version()}, PYTHONHASHSEED="
        f"{os.environ.get('PYTHONHASHSEED', 'random')} (the frequency sketch's collisions "
        "depend on it).",
        "Tokens saved (%) per contender, means over the seeds; margin: "
        f"`{DEFAULT}` minus the best baseline (target >= -{SLACK:g}); lead: `{DEFAULT}` minus the "
        f"best other contender, baselines and our policies (issue 41: >= -{CONTENDER_SLACK:g} on "
        f"every cell, >= +{LEAD:g} on half); to opt: the better of `{OPTIMUM}` (Belady on "
        f"bytes) and `{OPTIMUM_COST}` (Belady weighed by tokens per byte) minus `{DEFAULT}`; "
        f"churn: bytes evicted per byte inserted, `{DEFAULT}` / `lru` / `{PAGED}`.",
        "",
        f"Cells where `{DEFAULT}` is more than {CONTENDER_SLACK:g} point behind the best other "
        f"contender: {len(behind)} of {len(grid)}"
        + (f" ({', '.join(behind)})" if behind else "")
        + f". Cells where it leads by >= {LEAD:g} point: {ahead} of {len(grid)}.",
        f"Cells where `{DEFAULT}` is more than {SLACK:g} point behind the best baseline: "
        f"{len(missed)} of {len(grid)}" + (f" ({', '.join(missed)})" if missed else "") + ".",
        f"Steady and scan cells where it is not {LRU_MARGIN:g} points over `lru`: "
        f"{len(lru_missed)}" + (f" ({', '.join(lru_missed)})" if lru_missed else "") + ".",
        "",
        "| cell | " + " | ".join(names) + " | margin | lead | to opt | churn |",
        "|---|" + "---:|" * (len(names) + 3) + "---|",
    ]
    for cell, s in grid.items():
        churn = f"{s.churn[DEFAULT]:.2f} / {s.churn['lru']:.2f} / {s.churn[PAGED]:.2f}"
        out.append(
            f"| {cell.label} | "
            + " | ".join(f"{s.saved[n]:.1f}" for n in names)
            + f" | {s.margin():+.1f} | {s.lead():+.1f} | {s.offline - s.saved[DEFAULT]:.1f}"
            f" | {churn} |"
        )
    return "\n".join(out) + "\n"


def rows_of(grid: dict[Cell, Summary]) -> list[dict[str, Any]]:
    """A target row per cell (the default against the best baseline, and against our LRU on
    steady and scan), the optimum's margin per cell, and the churn of the drifting cells."""
    rows = []
    for cell, s in grid.items():
        best = s.best_baseline
        rows.append(
            make_row(
                f"grid {cell.label}: tokens saved, {DEFAULT} vs best baseline ({best})",
                s.saved[DEFAULT],
                s.saved[best],
                "%",
                s.saved[DEFAULT] / s.saved[best],
                f">= baseline - {SLACK:g}",
                s.margin() >= -SLACK,
            )
        )
        if cell.mix in ("steady", "scan"):
            rows.append(
                make_row(
                    f"grid {cell.label}: tokens saved, {DEFAULT} vs lru",
                    s.saved[DEFAULT],
                    s.saved["lru"],
                    "%",
                    s.saved[DEFAULT] / s.saved["lru"],
                    f">= baseline + {LRU_MARGIN:g}",
                    s.saved[DEFAULT] >= s.saved["lru"] + LRU_MARGIN,
                )
            )
        rows.append(
            make_row(
                f"grid {cell.label}: tokens saved, {DEFAULT} vs {OPTIMUM}",
                s.saved[DEFAULT],
                s.saved[OPTIMUM],
                "%",
                s.saved[DEFAULT] / s.saved[OPTIMUM],
                "",
                None,
            )
        )
        if cell.mix == "drift":
            rows.append(
                make_row(
                    f"grid {cell.label}: bytes evicted per byte inserted, {DEFAULT} vs {PAGED}",
                    s.churn[DEFAULT],
                    s.churn[PAGED],
                    "B/B",
                    s.churn[DEFAULT] / s.churn[PAGED] if s.churn[PAGED] else None,
                    "",
                    None,
                )
            )
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run.py`` (``quick``: the tiny grid)."""
    return rows_of(measure(quick))


def heat(rows: list[dict[str, Any]]) -> dict[str, dict[tuple[str, float], tuple[float, float]]]:
    """From ``rows_of``'s rows: pool -> (row label, skew) -> (the default's margin over the best
    baseline, the optimum's over the default); steady and scan sit in a last row."""
    out: dict[str, dict[tuple[str, float], list[float]]] = {}
    for row in rows:
        name = row["name"]
        if not name.startswith("grid ") or ": tokens saved, " not in name:
            continue
        label, _, versus = name[len("grid ") :].partition(": tokens saved, ")
        pool, _, mix = label.partition(" ")
        if mix.startswith("drift "):
            period, skew = mix.split()[1], float(mix.split()[2][1:])
            key = (f"drift {period}", skew)
        else:
            key = ("steady / scan", 0.0 if mix == "steady" else 1.0)
        cell = out.setdefault(pool, {}).setdefault(key, [math.nan, math.nan])
        if " vs best baseline" in versus:
            cell[0] = row["ours"] - row["baseline"]
        elif versus.endswith(f" vs {OPTIMUM}"):
            cell[1] = row["baseline"] - row["ours"]
    return {pool: {k: (v[0], v[1]) for k, v in cells_.items()} for pool, cells_ in out.items()}


def as_json(grid: dict[Cell, Summary], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``--json``'s object: ``rows``; ``cells``, in the grid's order, each with its label, the
    means of each contender (``saved``, ``churn``) and the default's ``margin``; and ``heat``,
    pool -> ``[row label, skew, margin, optimum's margin]`` read back from the rows."""
    return {
        "rows": [json_row(r) for r in rows],
        "cells": [
            {
                "label": c.label,
                "saved": s.saved,
                "churn": s.churn,
                "margin": s.margin(),
                "lead": s.lead(),
                "best_other": s.best_other(),
            }
            for c, s in grid.items()
        ],
        "heat": {
            pool: [[label, skew, *pair] for (label, skew), pair in values.items()]
            for pool, values in heat(rows).items()
        },
    }


def plot(plt: Any, rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Heatmaps per pool, drift period x skew: the default's margin over the best baseline,
    and the optimum's margin over the default (points of tokens saved)."""
    grid = heat(rows)
    if not grid:
        return None
    fig, axes = plt.subplots(len(grid), 2, figsize=(11, 3.6 * len(grid)), dpi=100, squeeze=False)
    for row, (pool, values) in enumerate(grid.items()):
        drifts = sorted({k[0] for k in values if k[0] != "steady / scan"}, key=lambda t: int(t[6:]))
        labels = [*drifts, "steady / scan"]
        skews = sorted({k[1] for k in values if k[0] != "steady / scan"})
        titles = (f"{DEFAULT} - best baseline", f"{OPTIMUM} - {DEFAULT}")
        for col, (title, cmap) in enumerate(zip(titles, ("RdYlGn", "Blues"), strict=True)):
            matrix = [[math.nan] * len(skews) for _ in labels]
            for (label, skew), pair in values.items():
                column = skews.index(skew) if label != "steady / scan" else int(skew)
                matrix[labels.index(label)][min(column, len(skews) - 1)] = pair[col]
            finite = [abs(v) for line in matrix for v in line if not math.isnan(v)] or [1.0]
            bound = max(max(finite), 0.5)
            ax = axes[row][col]
            image = ax.imshow(
                matrix, cmap=cmap, vmin=-bound if col == 0 else 0, vmax=bound, aspect="auto"
            )
            for i, line in enumerate(matrix):
                for j, v in enumerate(line):
                    if not math.isnan(v):
                        ax.text(j, i, f"{v:+.1f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(skews)))
            ax.set_xticklabels([f"z{s:g}" for s in skews])
            ax.set_yticks(range(len(labels)))
            ax.set_yticklabels(labels)
            ax.set_title(f"{pool}: {title} (points; last row: steady, scan)", fontsize=9)
            fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path = out / "policy_grid.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_saved(plt: Any, grid: dict[Cell, Summary], out: Path, name: str) -> Path:
    """Tokens saved per cell, one line per contender, the two offline rules among them (the
    distance to the optimum beside every policy): one panel per pool."""
    pools = list(dict.fromkeys(cell.pool.name for cell in grid))
    fig, axes = plt.subplots(len(pools), 1, figsize=(13, 4.2 * len(pools)), dpi=100, squeeze=False)
    names = [*BASELINES, *OURS, OPTIMUM, OPTIMUM_COST]
    for ax, pool in zip((row[0] for row in axes), pools, strict=True):
        here = [(cell, s) for cell, s in grid.items() if cell.pool.name == pool]
        xs = range(len(here))
        for contender in names:
            offline = contender in (OPTIMUM, OPTIMUM_COST)
            ax.plot(
                xs,
                [s.saved[contender] for _, s in here],
                marker="o" if contender == DEFAULT else ".",
                linestyle="--" if offline else "-",
                linewidth=2 if contender == DEFAULT else 1,
                label=contender,
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([c.label[len(pool) + 1 :] for c, _ in here], rotation=60, fontsize=7)
        ax.set_ylabel("encoder tokens saved (%)")
        ax.set_title(f"{pool}: every contender and the offline rules", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    path = out / name
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a corner of the grid, one seed")
    parser.add_argument("--five", action="store_true", help="issue 41's five mixes, not the grid")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write DIR/policy_grid.png")
    parser.add_argument("--jobs", type=int, default=1, help="processes running the cells")
    parser.add_argument("--markdown", type=Path, metavar="OUT", help="write the grid to OUT")
    parser.add_argument(
        "--json", type=Path, metavar="OUT", help="write the rows, each cell's means and the heat"
    )
    parser.add_argument(
        "--variant",
        metavar="MODULE:NAME",
        help=f"run only this policy (a class or function) in place of {DEFAULT}, against --against",
    )
    parser.add_argument(
        "--against", type=Path, metavar="JSON", help="a --json of the same cells, for --variant"
    )
    args = parser.parse_args()
    if args.variant is not None:
        if args.against is None:
            parser.error("--variant needs --against JSON")
        stored_run = json.loads(args.against.read_text(encoding="utf-8"))
        variant = measure_variant(args.variant, stored_run, args.tiny, args.five, args.jobs)
        print(variant_report(args.variant, variant))
        raise SystemExit(0)
    started = time.perf_counter()
    results = measure(args.tiny, args.jobs, args.five)
    if args.markdown is not None:
        page = markdown(results, time.perf_counter() - started, args.jobs, args.tiny, args.five)
        args.markdown.write_text(page, encoding="utf-8")
    print(table(results))
    print()
    rows = rows_of(results)
    print_rows(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(results, rows), indent=1) + "\n")
    if args.plot is not None:
        from benchmarks.common import require_matplotlib

        args.plot.mkdir(parents=True, exist_ok=True)
        stem = "policy_five" if args.five else "policy_grid"
        if not args.five:
            print(plot(require_matplotlib(), rows, args.plot))
        print(plot_saved(require_matplotlib(), results, args.plot, f"{stem}_saved.png"))
