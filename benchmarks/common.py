"""What the benchmarks share: making and printing rows (their format and check are in
``tests/support/rows.py``), the section a run produces, filling a cache, traced bytes, and
matplotlib.

Every benchmark module imports from here and this module imports no other benchmark module, so
the benchmarks' imports form no circle (``tests/test_benchmarks.py`` checks it). A helper two
benchmarks need belongs here, not in one of them.
"""

from __future__ import annotations

import gc
import hashlib
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from embcache import Request
from tests.support.rows import Row


@dataclass
class Section:
    """One item of the suite (``benchmarks/run.py``) and what it produced."""

    number: int
    title: str
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


# ---------------------------------------------------------------------------- rows
def make_row(
    name: str,
    ours: float,
    base: float | None,
    unit: str,
    ratio: float,
    target: str,
    met: bool | None,
) -> Row:
    """One row of ``benchmarks/run.py``'s table and JSON."""
    return {
        "name": name,
        "ours": ours,
        "baseline": base,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "met": met,
    }


def skipped_row(name: str, why: str, target: str = "") -> Row:
    """A row for a benchmark that could not run here (a peer or a service missing): ``why``."""
    return {
        "name": f"{name} (skipped: {why})",
        "ours": None,
        "baseline": None,
        "unit": "",
        "ratio": None,
        "target": target,
        "met": None,
    }


def growth_row(
    what: str, sizes: list[int], cost_at: dict[int, float], unit: str, limit: float
) -> Row:
    """The row judging flatness: cost at the largest size over cost at the smallest."""
    growth = cost_at[sizes[-1]] / cost_at[sizes[0]]
    return make_row(
        f"{what} growth {sizes[-1]} vs {sizes[0]} {unit}",
        growth,
        None,
        "x",
        growth,
        f"<= {limit:g}x",
        growth <= limit,
    )


def print_rows(rows: list[Row]) -> None:
    """Print rows as a fixed-width table on stdout."""
    print(f"{'benchmark':44} {'ours':>12} {'baseline':>12} {'unit':>8} {'ratio':>9}  target")

    def number(value: float | None, width: int, digits: int) -> str:
        return " " * width if value is None else f"{value:{width}.{digits}f}"

    for r in rows:
        met = {True: "met", False: "MISSED", None: ""}[r["met"]]
        print(
            f"{r['name']:44} {number(r['ours'], 12, 2)} {number(r['baseline'], 12, 2)} "
            f"{r['unit']:>8} {number(r['ratio'], 9, 2)}  {r['target']} {met}"
        )


# ---------------------------------------------------------------------------- filling a cache
def insert_all(request: Request, keys: list[str], tensor: torch.Tensor, chunk: int = 256) -> None:
    """Insert ``tensor`` under every key, in batches: ``insert`` checks each key of a batch
    against the ones before it (quadratic in the batch length)."""
    for start in range(0, len(keys), chunk):
        batch = keys[start : start + chunk]
        assert all(request.insert(batch, [tensor] * len(batch), publish=False))


def hex_keys(count: int) -> list[str]:
    """``count`` 64-character hex digests, as image hashes are."""
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(count)]


def traced_bytes(build: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes still allocated after ``build()`` (whose result is kept alive), and the result."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return after - before, kept


# ---------------------------------------------------------------------------- plots
def require_matplotlib() -> Any:
    """Import matplotlib with a headless backend, or raise a clear error."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(
            "--plots needs matplotlib: pip install matplotlib (or the dev extra)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
