"""PNG plots of a benchmark run (``python -m benchmarks.run --plots DIR``), with matplotlib.

Each plot is drawn from the rows of one item; the x values (live blocks, entries, MB, threads)
are read from the row names, which the benchmarks keep in a fixed form. An item that did not
run, or whose rows say skipped, draws nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Section, require_matplotlib


def _series(rows: Sequence[Row], pattern: str) -> list[tuple[float, Row]]:
    """(x, row) for the rows whose name matches ``pattern`` (group 1 is x), by x."""
    found = []
    for row in rows:
        match = re.search(pattern, row["name"])
        if match and row["ours"] is not None:
            found.append((float(match.group(1)), row))
    return sorted(found, key=lambda pair: pair[0])


def _lines(
    plt: Any,
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    points: list[tuple[float, Row]],
    labels: tuple[str, str],
    extra: Sequence[tuple[str, list[tuple[float, float]]]] = (),
    log: bool = True,
) -> Path | None:
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    xs = [x for x, _ in points]
    ax.plot(xs, [r["ours"] for _, r in points], "o-", label=labels[0])
    if all(r["baseline"] is not None for _, r in points):
        ax.plot(xs, [r["baseline"] for _, r in points], "s--", label=labels[1])
    for label, series in extra:
        ax.plot([x for x, _ in series], [y for _, y in series], "^:", label=label)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _bars(
    plt: Any,
    path: Path,
    title: str,
    ylabel: str,
    groups: list[tuple[str, list[float]]],
    labels: Sequence[str],
) -> Path | None:
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar(
            [g + i * width for g in range(len(groups))],
            [values[i] for _, values in groups],
            width,
            label=label,
        )
    ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([name for name, _ in groups])
    ax.set(title=title, ylabel=ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _allocator(plt: Any, rows: list[Row], out: Path) -> Path | None:
    points = _series([r for r in rows if r["unit"] == "us/pair"], r"(\d+) live blocks")
    return _lines(
        plt,
        out / "allocator.png",
        "Allocate+free pair",
        "live blocks",
        "us per pair",
        points,
        ("RangeAllocator (best fit)", "naive first fit"),
    )


def _eviction(plt: Any, rows: list[Row], out: Path) -> Path | None:
    points = _series([r for r in rows if r["unit"] == "us/op"], r"(\d+) entries, half pinned")
    return _lines(
        plt,
        out / "eviction.png",
        "Insert that evicts, oldest half pinned",
        "entries",
        "us per insert",
        points,
        ("EmbeddingCache", "LRU list scanned from the head"),
    )


def _hitpath(plt: Any, rows: list[Row], out: Path) -> Path | None:
    points = _series(rows, r"(\d+) entries, vs dict\+move$")
    views = [(x, r["baseline"]) for x, r in _series(rows, r"(\d+) entries, vs dict\+move\+view")]
    return _lines(
        plt,
        out / "hitpath.png",
        "Hit path: lookup+pin+view+release",
        "entries",
        "us per item",
        points,
        ("EmbeddingCache", "dict + OrderedDict.move_to_end"),
        [("dict + move + torch view", views)],
    )


def _bandwidth(
    plt: Any, rows: list[Row], out: Path, name: str, title: str, labels: tuple[str, str]
) -> Path | None:
    groups = [
        (f"{int(x)} MB", [r["ours"], r["baseline"]])
        for x, r in _series([r for r in rows if r["unit"] == "GB/s"], r"(\d+) MB")
    ]
    return _bars(plt, out / name, title, "GB/s", groups, labels)


def _fragmentation(plt: Any, rows: list[Row], out: Path) -> Path | None:
    hits = [r for r in rows if r["name"].startswith("hit ratio, ")]
    wasted = {r["name"].split(", ", 1)[1]: r for r in rows if r["name"].startswith("evicted for")}
    if not hits:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.2), dpi=100)
    names = ["embcache"] + [r["name"].split(", ", 1)[1] for r in hits]
    left.bar(
        names, [hits[0]["ours"]] + [r["baseline"] for r in hits], color=["C0"] + ["C1"] * len(hits)
    )
    left.set(title="Hit ratio (realistic mix)", ylabel="%")
    right.bar(
        names,
        [next(iter(wasted.values()))["ours"] if wasted else 0.0]
        + [wasted[n]["baseline"] if n in wasted else 0.0 for n in names[1:]],
        color=["C0"] + ["C1"] * len(hits),
    )
    right.set(title="Bytes evicted for nothing", ylabel="MiB")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "fragmentation.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _concurrency(plt: Any, rows: list[Row], out: Path) -> Path | None:
    points = _series(rows, r"(\d+) threads")
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.plot([x for x, _ in points], [r["ours"] for _, r in points], "o-", label="demo workload")
    ax.set_xscale("log", base=2)
    ax.set_xticks([x for x, _ in points], [str(int(x)) for x, _ in points])
    ax.set(
        title="Demo workload throughput",
        xlabel="client threads",
        ylabel="requests/s",
        ylim=(0, None),
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "concurrency.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _policy(plt: Any, rows: list[Row], out: Path) -> Path | None:
    from benchmarks.policy import bench_policy, bench_policy_grid

    bench_policy_grid.plot(plt, rows, out)
    return bench_policy.plot(plt, rows, out)


PLOTS: dict[int, Callable[[Any, list[Row], Path], Path | None]] = {
    1: _allocator,
    2: _eviction,
    3: _hitpath,
    4: lambda plt, rows, out: _bandwidth(
        plt,
        rows,
        out,
        "copy.png",
        "Reading items out of the pool",
        ("through the cache", "raw torch copy"),
    ),
    5: _fragmentation,
    7: lambda plt, rows, out: _bandwidth(
        plt,
        rows,
        out,
        "mooncake.png",
        "Mooncake loads (TCP loopback)",
        ("through the cache", "raw batch_get_into"),
    ),
    8: _concurrency,
    9: _policy,
}


def write_plots(sections: Sequence[Section], out: Path) -> list[Path]:
    """Draw one PNG per item that has something to draw; returns the paths written."""
    plt = require_matplotlib()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for section in sections:
        draw = PLOTS.get(section.number)
        if draw is None or section.error:
            continue
        path = draw(plt, section.rows, out)
        if path is not None:
            written.append(path)
    return written
