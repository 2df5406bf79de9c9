"""A benchmark's result row, as ``benchmarks/run.py`` and every ``--json`` write it, and its check.

A row is ``{name, ours, baseline, unit, ratio, target, met}`` (``ROW_KEYS``). The benchmarks
check their rows with ``check_row`` before writing them, and tests check the rows a benchmark
run wrote with the same function.
"""

from __future__ import annotations

import math
from typing import Any

Row = dict[str, Any]
ROW_KEYS = ("name", "ours", "baseline", "unit", "ratio", "target", "met")


def check_row(row: Any) -> None:
    """Raise ``ValueError`` unless ``row`` is a well-formed result row."""
    if not isinstance(row, dict) or tuple(sorted(row)) != tuple(sorted(ROW_KEYS)):
        raise ValueError(f"a row has exactly the keys {ROW_KEYS}: {row!r}")
    if not isinstance(row["name"], str) or not row["name"]:
        raise ValueError(f"row name must be a non-empty str: {row!r}")
    for key in ("ours", "baseline", "ratio"):
        value = row[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"row {key} must be a number or None: {row!r}")
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"row {key} is NaN: {row!r}")
    if not isinstance(row["unit"], str) or not isinstance(row["target"], str):
        raise ValueError(f"row unit and target must be str: {row!r}")
    if not any(row["met"] is value for value in (True, False, None)):
        raise ValueError(f"row met must be True, False or None: {row!r}")
    if row["met"] is not None and not row["target"]:
        raise ValueError(f"row met is set but it has no target: {row!r}")


def json_row(row: Row) -> Row:
    """``row`` with numbers as JSON can hold them (an infinite ratio becomes null)."""
    out: Row = {}
    for key in ROW_KEYS:
        value = row[key]
        if isinstance(value, bool) or value is None or isinstance(value, str):
            out[key] = value
        elif isinstance(value, int | float):
            out[key] = float(value) if math.isfinite(value) else None
        else:
            out[key] = value
    return out
