"""The committed table of issue 57's rule (``benchmarks.policy.choose_default``) and the
default policy it names, for the tests that check every default follows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parents[2] / "benchmarks/policy/results/default_policy.json"


def table() -> dict[str, Any]:
    """The committed report: ``default``, ``rule``, ``policies``, ``seeds``, ``cells``, ..."""
    report: dict[str, Any] = json.loads(TABLE.read_text(encoding="utf-8"))
    return report


def chosen() -> str:
    """The default policy the committed table names."""
    name: str = table()["default"]
    return name
