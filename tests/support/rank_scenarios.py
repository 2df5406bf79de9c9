"""Run a module's scenarios on a gloo group of spawned processes (loopback), once per list.

Starting processes costs seconds and a scenario milliseconds, so one spawn runs every scenario
of a module (its ``SCENARIOS``) in order; each rank records "ok" or its traceback per scenario
in a JSON file, and one pytest test per scenario reports every rank's outcome (``report``).
Used by the SGLang adapter's contract tests and the pipeline's tensor-parallel tests.
"""

from __future__ import annotations

import datetime
import importlib
import json
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.ports import rendezvous
from tests.support.processes import Ended, spawned_ranks

# How long a rank waits for the others at the end of a scenario (and the group's default
# timeout). Rank 0 may take a while: after a master died, closing its Mooncake clients (and a
# fence the cache started by itself to free the ranges of unknown outcomes) waits out
# Mooncake's own RPC retries, 10 s and more on a loaded machine. (20 s was too short there: the
# other rank gave up and torch ended rank 0.)
BARRIER_S = 90.0


@dataclass
class Rank:
    """What a scenario gets: this process's rank, the world size and the test's arguments."""

    rank: int
    world: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> dist.ProcessGroup:
        """The group of every rank."""
        group = dist.group.WORLD
        assert group is not None
        return group

    def same_on_every_rank(self, value: object) -> None:
        values: list[object] = [None] * self.world
        dist.all_gather_object(values, value)
        assert all(v == values[0] for v in values), f"ranks differ: {values}"


Scenario = Callable[[Rank], None]


def _worker(
    rank: int,
    world: int,
    init_method: str,
    outdir: str,
    module: str,
    args: dict[str, Any],
    timeout_s: float,
    barrier_s: float,
) -> None:
    from embcache.driver.locks import enable_lock_checking

    enable_lock_checking()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    scenarios: list[Scenario] = importlib.import_module(module).SCENARIOS
    results: dict[str, str] = {}
    path = Path(outdir) / f"rank{rank}.json"
    r = Rank(rank, world, args)
    try:
        for scenario in scenarios:
            try:
                scenario(r)
                results[scenario.__name__] = "ok"
            except BaseException:
                results[scenario.__name__] = traceback.format_exc()
            path.write_text(json.dumps(results))
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=barrier_s))
    finally:
        path.write_text(json.dumps(results))
        dist.destroy_process_group()


def run_ranks(
    module: str,
    outdir: Path,
    args: dict[str, Any],
    world: int = 2,
    deadline_s: float = 120.0,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = BARRIER_S,
    barrier_s: float = BARRIER_S,
) -> tuple[dict[int, dict[str, str]], Ended]:
    """Run ``module``'s ``SCENARIOS`` on ``world`` ranks (``env`` set for them, one OpenMP
    thread each; ``timeout_s`` the group's default timeout, ``barrier_s`` the wait after each
    scenario); rank -> scenario name -> outcome, and how the ranks ended. A rank that ended
    with a non-zero exit code has it recorded as ``(exit code)``."""
    ended = spawned_ranks(
        _worker,
        (world, rendezvous(outdir), str(outdir), module, args, timeout_s, barrier_s),
        world,
        deadline_s,  # past it, the outcomes so far say which scenario hung
        {"OMP_NUM_THREADS": "1", **(env or {})},
    )
    exits = ended.exit_codes
    results = {}
    for rank in range(world):
        path = outdir / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
        if exits[rank] != 0:  # a negative exit code is the signal that ended it
            results[rank]["(exit code)"] = str(exits[rank])
    return results, ended


def report(outcomes: dict[int, dict[str, str]], scenario: str) -> None:
    """Fail with every rank's traceback unless ``scenario`` passed on all of them."""
    failures = {
        rank: results.get(
            scenario,
            "did not run (an earlier scenario hung, or the rank died: exit code "
            f"{results.get('(exit code)', '0')})",
        )
        for rank, results in outcomes.items()
        if results.get(scenario) != "ok"
    }
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())
