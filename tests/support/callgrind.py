"""Reading callgrind's output: the instruction total of a dump, the totals of numbered dumps,
and the count per operation of two dumps per side (``benchmarks/peers/bench_instructions.py``,
``benchmarks/peers/bench_vllm.py --callgrind``)."""

from __future__ import annotations

import re
from pathlib import Path


class Unavailable(RuntimeError):
    """The count cannot run here (no valgrind, or the run failed): the message says why."""


def total(path: Path) -> int:
    """The instruction count of one callgrind output file (its ``totals:`` or ``summary:``)."""
    text = path.read_text()
    found = re.search(r"^(?:totals|summary):\s*(\d+)", text, re.MULTILINE)
    if found is None:
        raise Unavailable(f"no totals in callgrind output {path}")
    return int(found.group(1))


def dump_totals(out: Path) -> list[int]:
    """The ``totals:`` instruction count of each callgrind dump ``out.1``, ``out.2``, ..."""
    counts = []
    for n in range(1, 10):
        dump = out.with_name(f"{out.name}.{n}")
        if not dump.exists():
            break
        lines = dump.read_text().splitlines()
        counts.append(next(int(x.split()[1]) for x in lines if x.startswith("totals:")))
    return counts


def per_operation(order: list[str], counts: list[int], span: int) -> dict[str, float]:
    """Each side's count per operation: its second region's count minus its first's, over
    the ``span`` operations more that the second ran. ``order`` names each dump's side."""
    per_op: dict[str, float] = {}
    for i in range(0, len(order), 2):
        assert order[i] == order[i + 1], order
        per_op[order[i]] = (counts[i + 1] - counts[i]) / span
    return per_op
