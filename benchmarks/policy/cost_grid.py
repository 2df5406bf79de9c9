"""Admission by encoder work per byte (issue 41, point 2), measured where that work is not
proportional to bytes.

The cells and seeds are ``bench_policy_grid``'s (``--five``: issue 41's five mixes; else the
grid), but each image's encoder work is its tokens x a factor drawn once per image,
log-uniform in [1/``SPREAD``, ``SPREAD``] (images of one catalogue through encoders, resolutions
or preprocessing of different cost), while its bytes stay its tokens' bytes. Every contender
(the baselines, ``lru``, ``tinylfu``, ``adaptive``, both offline rules) then reports the share
of encoder work saved where the grid reports tokens (``optimum-cost`` becomes Belady weighed by
work per byte). Beside them, the cost-aware admission as an oracle (each image's work read from
the workload, as the driver would measure and report it):

- ``tinylfu-cost``: TinyLFU whose filter admits a candidate only if its recent lookups x its
  encoder work per byte are above each victim's (``CostFilter``);
- ``adaptive-cost``: ``adaptive`` with that filter as its filter expert (its shadow too);
- ``adaptive-blind``, the control: ``adaptive-cost`` given each image's tokens in place of its
  work (the same rule and rounding, none of the information): what the rule alone does.

Beside the oracles, the real policy, ``adaptive-work`` (``embcache.core.policy``), simulated as
the cache runs it: it is told each fresh output's work at its EndLoad (as the encode pipeline
passes its measured encoder seconds), remembers it while the entry is present and for a
bounded number of recently freed keys, and takes a key it knows no work of to cost the running
mean work per byte; so it admits a candidate by what it remembers, not by what it will cost.

Cost model (what ``CostFilter`` states): a hit of key k saves one encoder run of k, ``work(k)``
(seconds, here token-equivalents); holding k costs its bytes ``b(k)``; with ``f(k)`` its
recent lookups (the filter's counts), k's worth per byte is f(k) x work(k) / b(k), and a
candidate displaces victims only if its worth per byte is above each victim's. With work
proportional to bytes this is ``tinylfu``'s rule. Run from the repository root:
python -m benchmarks.policy.cost_grid [--five] [--jobs N] [--markdown OUT]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from benchmarks.policy import bench_policy_grid as grid
from benchmarks.policy.bench_policy import simulate
from embcache.core.policy import AdaptivePolicy, TinyLfuPolicy, make_policy
from tests.support import mixes

SPREAD = 4.0  # an image's encoder work per token is its tokens' x [1/SPREAD, SPREAD]
COST_SEED = 1_000  # added to a run's seed for the factors
REAL = "adaptive-work"  # the policy the product has: work measured at EndLoad, remembered
CONTENDERS = (
    *grid.BASELINES, *grid.OURS, "tinylfu-cost", "adaptive-cost", "adaptive-blind", REAL
)  # fmt: skip
CHOSEN = "adaptive-cost"
BLIND = "adaptive-blind"  # the control: CostAdaptive given the tokens, not the work


@dataclass(frozen=True)
class CostSpec:
    """An image whose encoder work (``tokens``, what a hit saves) is not its bytes' measure."""

    key: str
    tokens: int  # encoder work of one miss, in token-equivalents
    nbytes: int


def cost_workload(load: mixes.Workload, seed: int) -> mixes.Workload:
    """``load`` with each image's work scaled by a factor log-uniform in [1/SPREAD, SPREAD]
    (drawn from ``seed``); its bytes unchanged."""
    rng = random.Random(seed + COST_SEED)
    specs = [
        CostSpec(s.key, max(1, round(s.tokens * SPREAD ** rng.uniform(-1, 1))), s.nbytes)
        for s in load.specs
    ]
    return mixes.Workload(specs, load.requests, load.inflight)  # type: ignore[arg-type]


class _WorthPerByte:
    """What both oracles share: each key's encoder work per aligned byte, read from the
    workload, and a key's worth: its recent lookups (the policy's ``estimate``) x that."""

    _worth: dict[str, float]
    estimate: Callable[[str], int]

    def _read_worth(self, workload: mixes.Workload) -> None:
        self._worth = {s.key: s.tokens / mixes.aligned(s.nbytes) for s in workload.specs}

    def worth(self, key: str) -> float:
        """Recent lookups x encoder work per byte of ``key``. O(1)."""
        return self.estimate(key) * self._worth[key]

    def worth_more(self, key: str, victims: Sequence[str]) -> bool:
        """Whether ``key``'s worth is above each victim's. O(victims)."""
        mine = self.worth(key)
        return all(mine > self.worth(victim) for victim in victims)


class CostFilter(_WorthPerByte, TinyLfuPolicy):
    """TinyLFU whose filter weighs each key's recent lookups by its encoder work per byte."""

    name = "tinylfu-cost"
    ORACLE: ClassVar[bool] = True

    def __init__(self, workload: mixes.Workload, capacity: int) -> None:
        super().__init__()
        self._read_worth(workload)

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """True iff ``key``'s worth per byte is above each victim's. O(victims)."""
        return self.worth_more(key, victims)


class CostAdaptive(_WorthPerByte, AdaptivePolicy):
    """``adaptive`` whose filter expert (and that expert's shadow) is ``CostFilter``'s."""

    name = "adaptive-cost"
    ORACLE: ClassVar[bool] = True

    def __init__(self, workload: mixes.Workload, capacity: int) -> None:
        super().__init__()
        self._read_worth(workload)

    def admit(self, key: str, nbytes: int, victims: Sequence[str]) -> bool:
        """True under the LRU expert; else iff ``key``'s worth per byte is above each
        victim's. O(victims)."""
        return not self.use_filter or self.worth_more(key, victims)

    def _enter_filter_shadow(self, key: str) -> None:
        shadow, cap = self._filter_shadow, self._entries()
        if len(shadow) < cap:
            shadow[key] = None
            return
        oldest = next(iter(shadow))
        if self.worth(key) > self.worth(oldest):
            del shadow[oldest]
            shadow[key] = None
        while len(shadow) > cap:
            shadow.popitem(last=False)


def run(cell: grid.Cell, seed: int, requests: int) -> dict[str, mixes.Result]:
    """Every contender, the cost-aware oracles too, on one seed of ``cell`` with work factors."""
    plain = grid.workload(cell, seed, requests)
    load = cost_workload(plain, seed)
    out = grid.run_load(load, cell.pool)
    for factory in (CostFilter, CostAdaptive):
        policy = factory(load, cell.pool.capacity)
        out[policy.name] = simulate(load, policy, capacity=cell.pool.capacity)
    blind = CostAdaptive(plain, cell.pool.capacity)
    out[BLIND] = simulate(load, blind, capacity=cell.pool.capacity)
    out[REAL] = simulate(load, make_policy(REAL), capacity=cell.pool.capacity)
    return out


def measure(five: bool, jobs: int) -> dict[grid.Cell, dict[str, float]]:
    """Per cell, each contender's share of encoder work saved (%), the mean over the seeds."""
    cells, requests, seeds = grid.runs_of(False, five)
    work = [(cell, seed) for cell in cells for seed in seeds]
    if jobs == 1:
        results = [run(cell, seed, requests) for cell, seed in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            results = [f.result() for f in [pool.submit(run, c, s, requests) for c, s in work]]
    out = {}
    for i, cell in enumerate(cells):
        mine = results[i * len(seeds) : (i + 1) * len(seeds)]
        names = list(mine[0])
        out[cell] = {n: statistics.fmean(r[n].tokens_saved for r in mine) for n in names}
    return out


def markdown(saved: dict[grid.Cell, dict[str, float]], five: bool, seconds: float) -> str:
    """The cells as a markdown page: each contender's work saved, and the leads."""
    _, requests, seeds = grid.runs_of(False, five)
    names = [*CONTENDERS, grid.OPTIMUM, grid.OPTIMUM_COST]
    out = [
        "# Admission by encoder work per byte, on work not proportional to bytes",
        "",
        "Generated by `python -m benchmarks.policy.cost_grid"
        + (" --five" if five else "")
        + " --markdown OUT`; do not edit by hand.",
        f"{len(saved)} cells x {len(seeds)} seeds ({', '.join(map(str, seeds))}) x {requests} "
        f"requests, {seconds:.0f} s; each image's encoder work its tokens x a factor "
        f"log-uniform in [1/{SPREAD:g}, {SPREAD:g}]. Encoder work saved (%), means over the "
        f"seeds; lead: `{CHOSEN}` minus the best contender but the cost-aware oracles; "
        f"vs adaptive: `{CHOSEN}` minus `adaptive`; `{BLIND}`: the control, the same rule "
        f"given tokens in place of work; to opt: `{grid.OPTIMUM_COST}` minus `{CHOSEN}`; "
        f"`{REAL}`: the real policy (work told at EndLoad, remembered, else the mean); "
        f"real lead: `{REAL}` minus the best contender but the cost-aware ones; to oracle: "
        f"`{CHOSEN}` minus `{REAL}`.",
        "",
        "| cell | "
        + " | ".join(names)
        + " | lead | vs adaptive | to opt | real lead | to oracle |",
        "|---|" + "---:|" * (len(names) + 5),
    ]
    leads: dict[str, list[float]] = {CHOSEN: [], REAL: []}
    for cell, s in saved.items():
        best = max(s[n] for n in (*grid.BASELINES, *grid.OURS))
        for name, lead in leads.items():
            lead.append(s[name] - best)
        out.append(
            f"| {cell.label} | "
            + " | ".join(f"{s[n]:.1f}" for n in names)
            + f" | {s[CHOSEN] - best:+.1f} | {s[CHOSEN] - s['adaptive']:+.1f}"
            f" | {s[grid.OPTIMUM_COST] - s[CHOSEN]:.1f} | {s[REAL] - best:+.1f}"
            f" | {s[CHOSEN] - s[REAL]:+.1f} |"
        )
    means = {
        n: statistics.fmean(s[n] for s in saved.values()) for n in ("adaptive", CHOSEN, BLIND, REAL)
    }
    out.append("")
    for name, lead in leads.items():
        behind = sum(x < -grid.CONTENDER_SLACK for x in lead)
        ahead = sum(x >= grid.LEAD for x in lead)
        out.append(
            f"`{name}`: {behind} of {len(lead)} cells more than {grid.CONTENDER_SLACK:g} point "
            f"behind the best other contender, {ahead} ahead by {grid.LEAD:g} or more, mean "
            f"lead {statistics.fmean(lead):+.2f}, worst {min(lead):+.2f}, best {max(lead):+.2f}."
        )
    gaps = [s[CHOSEN] - s[REAL] for s in saved.values()]
    out += [
        f"`{REAL}` to the oracle `{CHOSEN}`: mean {statistics.fmean(gaps):+.2f}, most "
        f"{max(gaps):+.2f}, least {min(gaps):+.2f} points. Mean work saved over the cells: "
        + ", ".join(f"`{n}` {v:.2f}" for n, v in means.items())
        + ".",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--five", action="store_true", help="issue 41's five mixes, not the grid")
    parser.add_argument("--jobs", type=int, default=1, help="processes running the cells")
    parser.add_argument("--markdown", type=Path, metavar="OUT", help="write the page to OUT")
    args = parser.parse_args()
    started = time.perf_counter()
    measured = measure(args.five, args.jobs)
    page = markdown(measured, args.five, time.perf_counter() - started)
    if args.markdown is not None:
        args.markdown.write_text(page, encoding="utf-8")
    print(page)
