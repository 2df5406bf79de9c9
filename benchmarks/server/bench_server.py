"""An encode server end to end: requests/s and latency with a real encoder, embcache vs the peers.

Concurrent clients (threads, closed loop: each sends its next request when the last one is
answered) replay one request trace (``tests.support.server_workload``: 1 to 8 images a request,
Zipf over a catalog of 64- to 4096-token images, mixes steady, drifting and scan) against each
contender (``benchmarks.server.contenders``): no cache; SGLang 0.5.23's controller (its own code,
from the wheel), embcache's SGLang adapter (``lru`` and the best policy) and the original PR's
controller (``original PR in MMEncoder``), all driven through MMEncoder's sequence; the original
PR's controller called directly (``original PR direct``: no asyncio hop, inserts on the
request's thread); and embcache's ``EncodePipeline``. Every
contender runs the same ``TinyViT`` (one instance) on the same images; every pool has the same
bytes, a fraction of the hot images' bytes, so the hot set does not fit; the global stores
hold nothing (no store time on any side).

Side by side: each mix's trace is cut into segments, and the contenders take turns segment by
segment (the order rotating), each keeping its cache from segment to segment; the first
segment warms the caches up and is not counted. So a burst of load from other processes on a
shared machine falls on every contender alike.

Rows per mix and contender: requests/s, p50 and p99 latency, encoder seconds, encoder tokens
saved (requested tokens not encoded), failed inserts (no space), admissions refused (policy),
bytes copied (hit bytes read from the pool + fresh bytes offered to it), failed requests, the
cache's share of request time (time in cache calls, building the response included, less the
waits for another request's encode of the same image / request time) and, beside it, the
share of those single-flight waits (``joins %``: they replace encodes; the pipeline's, from its
``stats().wait_seconds``). Written as JSON, with a plot of requests/s and p99 per contender
and mix next to it.

    python -m benchmarks.server.bench_server [--quick] [--json PATH] [--plot PATH] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.server.contenders import (
    ORIGINAL_PR_DIRECT,
    ORIGINAL_PR_MMENCODER,
    Contender,
    Lane,
    NoCache,
    OriginalPRServer,
    PipelineServer,
    adapter_server,
    original_pr_server,
    sglang_server,
)
from benchmarks.server.fleet import SIZES as FLEET_SIZES
from benchmarks.server.fleet import run_fleet
from benchmarks.server.scale import run_scale
from benchmarks.server.workload import SIZES, Config, MeteredEncoder
from tests.support import breakdown, sglang_wheel
from tests.support.server_workload import MIXES, Image, make_encoder, make_workload

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("verify", "mixes", "breakdown", "scale", "fleet")
SGLANG = "SGLang 0.5.23"


def contender_names(best_policy: str) -> tuple[str, ...]:
    """The contenders' names, in the order they run."""
    return (
        "no cache",
        SGLANG,
        ORIGINAL_PR_MMENCODER,
        ORIGINAL_PR_DIRECT,
        "embcache adapter lru",
        f"embcache adapter {best_policy}",
        f"embcache pipeline {best_policy}",
    )


@dataclass
class Tally:
    """One contender's measured requests in one mix."""

    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cache_seconds: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def make_contenders(
    encoder: Any, pool_bytes: int, best_policy: str, sglang_page_bytes: int
) -> tuple[list[Contender], dict[str, str]]:
    """Every contender (each with its own meter on ``encoder``), and those skipped, with why."""
    skipped: dict[str, str] = {}
    made: list[Contender] = [NoCache(MeteredEncoder(encoder))]
    try:
        made.append(sglang_server(MeteredEncoder(encoder), pool_bytes, sglang_page_bytes))
    except sglang_wheel.SGLangUnavailable as exc:
        skipped[SGLANG] = str(exc)
    made.append(original_pr_server(MeteredEncoder(encoder), pool_bytes))
    made.append(OriginalPRServer(MeteredEncoder(encoder), pool_bytes))
    made.append(adapter_server(MeteredEncoder(encoder), pool_bytes, "lru"))
    made.append(adapter_server(MeteredEncoder(encoder), pool_bytes, best_policy))
    made.append(PipelineServer(MeteredEncoder(encoder), pool_bytes, best_policy))
    return made, skipped


def run_segment(
    contender: Contender, requests: list[tuple[str, list[Image]]], clients: int, tally: Tally | None
) -> None:
    """Serve ``requests`` with ``clients`` threads; count them in ``tally`` (None: warm-up)."""
    order = iter(requests)
    lock = threading.Lock()
    seen: list[tuple[float, float]] = []
    errors: list[str] = []

    def client() -> None:
        lane = Lane()
        try:
            while True:
                with lock:
                    job = next(order, None)
                if job is None:
                    return
                try:
                    served = contender.serve(job[0], job[1], lane)
                    seen.append((served.seconds, served.cache_seconds))
                except Exception as exc:  # a failed request is counted, not retried
                    errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            lane.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    contender.finish()
    if tally is not None:
        tally.seconds += time.perf_counter() - start
        tally.latencies += [s for s, _ in seen]
        tally.cache_seconds += [c for _, c in seen]
        tally.failed += len(errors)
        tally.errors += errors[:3]


def run_mix(
    contenders: list[Contender], trace: list[list[Image]], mix: str, config: Config
) -> dict[str, dict[str, Any]]:
    """Each contender's row for one mix, the contenders taking turns segment by segment."""
    jobs = [(f"{mix}-{n}", images) for n, images in enumerate(trace)]
    cut = -(-len(jobs) // config.segments)
    segments = [jobs[i : i + cut] for i in range(0, len(jobs), cut)]
    tallies = {c.name: Tally() for c in contenders}
    before: dict[str, tuple[int, int, float, dict[str, int], float]] = {}
    for n, segment in enumerate(segments):
        turn = n % len(contenders)
        for contender in contenders[turn:] + contenders[:turn]:
            if n == 1:
                meter = contender.encoder.total
                before[contender.name] = (
                    meter.images,
                    meter.tokens,
                    meter.seconds,
                    dict(contender.counts),
                    contender.single_flight_seconds(),
                )
            run_segment(contender, segment, config.clients, tallies[contender.name] if n else None)
    requested = sum(i.tokens for _, images in jobs[cut:] for i in images)
    return {c.name: row(c, tallies[c.name], before[c.name], requested) for c in contenders}


def row(
    contender: Contender,
    tally: Tally,
    before: tuple[int, int, float, dict[str, int], float],
    requested_tokens: int,
) -> dict[str, Any]:
    """The measured numbers of one contender in one mix."""
    meter = contender.encoder.total
    images, tokens, seconds, counts, joined = before
    waits = contender.single_flight_seconds() - joined
    got = {k: contender.counts[k] - counts.get(k, 0) for k in contender.counts}
    lat = sorted(tally.latencies)
    served = len(lat)
    share, joins = breakdown.cache_shares(tally.cache_seconds, waits, lat)
    return {
        "requests": served,
        "failed_requests": tally.failed,
        "requests_per_s": served / tally.seconds if tally.seconds else 0.0,
        "p50_ms": 1e3 * statistics.median(lat) if lat else None,
        "p99_ms": 1e3 * lat[min(served - 1, int(0.99 * served))] if lat else None,
        "encoder_s": meter.seconds - seconds,
        "encoded_images": meter.images - images,
        "encoder_tokens_saved": requested_tokens - (meter.tokens - tokens),
        "failed_inserts": contender.failed_inserts(),
        "admissions_refused": contender.admissions_refused(),
        "bytes_copied": got.get("read_bytes", 0) + got.get("offered_bytes", 0),
        "cache_share": share,  # single-flight waits left out (they replace encodes) ...
        "single_flight_share": joins,  # ... and reported beside it
        "cache_ms_per_request": 1e3 * statistics.fmean(tally.cache_seconds) if lat else None,
        "errors": tally.errors,
    }


def measure(config: Config) -> dict[str, Any]:
    """Every mix, every contender: the rows, the ratios against SGLang, the set-up."""
    torch.set_num_threads(1)  # the clients are the parallelism; no oversubscription
    logging.getLogger(sglang_wheel.MODULE_NAME).setLevel(logging.ERROR)  # a line per failed alloc
    encoder = make_encoder(config.hidden)
    workload = make_workload(
        encoder, config.hot, config.requests, config.zipf_s, config.seed, config.mixes
    )
    pool_bytes = int(config.pool_fraction * workload.hot_bytes()) // 4096 * 4096
    result: dict[str, Any] = {
        "config": asdict(config),
        "pool_bytes": pool_bytes,
        "hot_bytes": workload.hot_bytes(),
        "mixes": {},
        "skipped": {},
    }
    for mix in config.mixes:
        contenders, skipped = make_contenders(
            encoder, pool_bytes, config.best_policy, config.sglang_page_bytes
        )
        result["skipped"].update(skipped)
        try:
            result["mixes"][mix] = run_mix(contenders, workload.mixes[mix], mix, config)
        finally:
            for contender in contenders:
                contender.close()
    result["ratios"] = ratios(result["mixes"], config.best_policy)
    return result


def measure_breakdown(config: Config, mixes: dict[str, Any] | None) -> dict[str, Any]:
    """Per mix and contender, where the cache time goes (``tests.support.breakdown``): the
    mixes served again with every contender's cache calls profiled, the contenders taking
    turns segment by segment, the first segment unprofiled (warm-up). ``mixes``: the unprofiled
    rows of the same run, to scale each share to ms per request (None: shares only)."""
    torch.set_num_threads(1)
    encoder = make_encoder(config.hidden)
    workload = make_workload(
        encoder, config.hot, config.requests, config.zipf_s, config.seed, config.mixes
    )
    pool_bytes = int(config.pool_fraction * workload.hot_bytes()) // 4096 * 4096
    out: dict[str, Any] = {}
    for mix in config.mixes:
        contenders, _ = make_contenders(
            encoder, pool_bytes, config.best_policy, config.sglang_page_bytes
        )
        contenders = [c for c in contenders if not isinstance(c, NoCache)]
        jobs = [(f"{mix}-{n}", images) for n, images in enumerate(workload.mixes[mix])]
        cut = -(-len(jobs) // config.segments)
        profiles = {c.name: breakdown.Profiles() for c in contenders}
        try:
            for n, at in enumerate(range(0, len(jobs), cut)):
                turn = n % len(contenders)
                for contender in contenders[turn:] + contenders[:turn]:
                    if n == 1:
                        contender.profile(profiles[contender.name])
                    run_segment(contender, jobs[at : at + cut], config.clients, None)
        finally:
            for contender in contenders:
                contender.close()
        rows: dict[str, Any] = {}
        for name, prof in profiles.items():
            shares = breakdown.shares(prof.seconds())
            unprofiled = ((mixes or {}).get(mix, {}).get(name) or {}).get("cache_ms_per_request")
            ms = {k: v * unprofiled for k, v in shares.items()} if unprofiled else {}
            rows[name] = {"shares": shares, "ms": ms}
        out[mix] = rows
    return out


def verify(config: Config) -> dict[str, Any]:
    """Every contender answers with the encoder's bytes: a small steady mix (12 hot images, 16
    requests) served twice (the second pass hits) by every contender over a pool of half the
    hot bytes, each answer compared with the encoder's output. Per contender: requests
    answered, answers that differ, requests SGLang's controller failed (a hit evicted before
    its read, "not available"; any other error raises), answers whose cache time is not within
    [0, the request's time], failed inserts, bytes read from the pool. Each contender is closed
    at the end (embcache's check their invariants then)."""
    torch.set_num_threads(1)
    encoder = make_encoder(config.hidden)
    work = make_workload(encoder, hot=12, requests=16, zipf_s=0.9, seed=1, mixes=("steady",))
    pool = int(0.5 * work.hot_bytes())
    contenders, skipped = make_contenders(
        encoder, pool, config.best_policy, config.sglang_page_bytes
    )
    out: dict[str, dict[str, Any]] = {}
    lane = Lane()
    try:
        for contender in contenders:
            counts = dict.fromkeys(("requests", "answered", "differ", "failed", "bad_times"), 0)
            for n, images in enumerate(work.mixes["steady"] * 2):
                counts["requests"] += 1
                try:
                    served = contender.serve(f"r{n}", images, lane)
                except RuntimeError as exc:
                    if "not available" not in str(exc):
                        raise
                    counts["failed"] += 1
                    continue
                counts["answered"] += 1
                expected = torch.cat(encoder([i.pixels for i in images]))
                counts["differ"] += not torch.equal(served.embeddings, expected)
                counts["bad_times"] += not 0 <= served.cache_seconds <= served.seconds
            contender.finish()
            counts["failed_inserts"] = contender.failed_inserts()
            counts["read_bytes"] = contender.counts["read_bytes"]
            out[contender.name] = counts
    finally:
        lane.close()
        for contender in contenders:
            contender.close()
    return {"contenders": out, "skipped": skipped}


SPREAD = (
    "requests_per_s", "p50_ms", "p99_ms", "cache_share", "single_flight_share",
    "cache_ms_per_request",
)  # fmt: skip


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeated ``measure`` runs: each number the median over the runs, each
    timing's range over the runs in ``spread`` ([low, high]), the runs themselves in
    ``repeats``, the ratios and the targets recomputed from the medians."""
    if len(runs) == 1:
        out = dict(runs[0])
    else:
        out = dict(runs[0], mixes={}, spread={}, repeats=[r["mixes"] for r in runs])
        for mix, rows in runs[0]["mixes"].items():
            for name, first in rows.items():
                each = [r["mixes"][mix][name] for r in runs]
                row = dict(first)
                for key, value in first.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        middle = statistics.median(e[key] for e in each)
                        row[key] = round(middle) if isinstance(value, int) else middle
                out["mixes"].setdefault(mix, {})[name] = row
                out["spread"].setdefault(mix, {})[name] = {
                    key: [min(e[key] for e in each), max(e[key] for e in each)] for key in SPREAD
                }
        out["ratios"] = ratios(out["mixes"], out["config"]["best_policy"])
    out["targets"] = targets(out["mixes"], out["config"]["best_policy"])
    return out


def targets(mixes: dict[str, dict[str, dict[str, Any]]], best: str) -> dict[str, dict[str, Any]]:
    """Per mix, the end-to-end targets. embcache's adapter serves at least the requests/s of
    every other controller driven through MMEncoder's sequence (SGLang's, the original PR's in
    MMEncoder) and spends at most the original PR's cache share in that sequence plus 3 points;
    embcache's pipeline serves at least every contender's requests/s and spends at most the
    minimal controller's share (the original PR's, called directly) plus 3 points."""
    out: dict[str, dict[str, Any]] = {}
    for mix, rows in mixes.items():
        others = {n: r for n, r in rows.items() if not n.startswith("embcache") and n != "no cache"}
        in_sequence = {n: r for n, r in others.items() if n in (SGLANG, ORIGINAL_PR_MMENCODER)}
        sides = {
            f"embcache adapter {best}": (in_sequence, rows.get(ORIGINAL_PR_MMENCODER)),
            f"embcache pipeline {best}": (others, rows.get(ORIGINAL_PR_DIRECT)),
        }
        for ours, (rivals, minimal) in sides.items():
            mine = rows[ours]
            fastest = max(rivals.values(), key=lambda r: r["requests_per_s"], default=None)
            out.setdefault(mix, {})[ours] = {
                "vs_fastest_contender": (
                    mine["requests_per_s"] / fastest["requests_per_s"] if fastest else None
                ),
                "share_over_minimal_pts": (
                    100 * (mine["cache_share"] - minimal["cache_share"]) if minimal else None
                ),
                "met": bool(
                    fastest
                    and minimal
                    and mine["requests_per_s"] >= fastest["requests_per_s"]
                    and mine["cache_share"] <= minimal["cache_share"] + 0.03
                ),
            }
    return out


def ratios(mixes: dict[str, dict[str, dict[str, Any]]], best: str) -> dict[str, dict[str, Any]]:
    """Per mix: embcache's requests/s over SGLang's, and its p99 over SGLang's."""
    out: dict[str, dict[str, Any]] = {}
    for mix, rows in mixes.items():
        theirs = rows.get(SGLANG)
        if theirs is None:
            continue
        for ours in (f"embcache adapter {best}", f"embcache pipeline {best}"):
            mine = rows[ours]
            out.setdefault(mix, {})[ours] = {
                "throughput_vs_sglang": mine["requests_per_s"] / theirs["requests_per_s"],
                "p99_vs_sglang": mine["p99_ms"] / theirs["p99_ms"],
            }
    return out


def table(result: dict[str, Any]) -> str:
    """The rows as a plain-text table."""
    lines = mix_table(result) if "mixes" in result else []
    for name, rows in result.get("scale", {}).items():
        for r in rows:
            lines.append(
                f"scale {name:28} pool {r['pool_bytes'] / 2**30:6.3f} GiB {r['entries']:6d} "
                f"entries {r['requests_per_s']:7.1f} req/s p50 {r['p50_ms']:7.1f} ms p99 "
                f"{r['p99_ms']:7.1f} ms cache {r['cache_ms_per_request']:6.2f} ms/request "
                f"{r['cache_us_per_item']:7.1f} us/item {100 * r['cache_share']:5.2f}%"
            )
    fleet = result.get("fleet", {})
    for r in fleet.get("rows", []):
        lines.append(
            f"fleet of {r['W']}, {r['contender']:12} {r['mix']:8} {r['encodes_per_image']:5.3f} "
            f"encodes/image, {r['duplicate_encodes']:4d} duplicates {r['requests_per_s']:7.1f} "
            f"req/s p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms store "
            f"{r['store_mb']:7.2f} MB, wrong {r['wrong_answers']}"
        )
    if "skipped" in fleet:
        lines.append(f"fleet: skipped: {fleet['skipped']}")
    return "\n".join(lines)


def mix_table(result: dict[str, Any]) -> list[str]:
    """The side-by-side rows of every mix."""
    lines = [
        f"pool {result['pool_bytes'] / 2**20:.0f} MiB for {result['hot_bytes'] / 2**20:.0f} MiB "
        "of hot images"
    ]
    head = (
        f"{'mix':9} {'contender':28} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'enc s':>7} "
        f"{'saved tok':>10} {'fail ins':>8} {'refused':>7} {'MiB copied':>10} {'cache %':>7} "
        f"{'joins %':>7} {'failed':>6}"
    )
    lines.append(head)
    for mix, rows in result["mixes"].items():
        for name, r in rows.items():
            share = r["cache_share"]
            lines.append(
                f"{mix:9} {name:28} {r['requests_per_s']:7.1f} {r['p50_ms'] or 0:8.1f} "
                f"{r['p99_ms'] or 0:8.1f} {r['encoder_s']:7.1f} {r['encoder_tokens_saved']:10d} "
                f"{r['failed_inserts']:8d} {r['admissions_refused']:7d} "
                f"{r['bytes_copied'] / 2**20:10.0f} {100 * (share or 0):7.2f} "
                f"{100 * (r.get('single_flight_share') or 0):7.2f} {r['failed_requests']:6d}"
            )
    for mix, by_side in result.get("ratios", {}).items():
        for name, r in by_side.items():
            lines.append(
                f"{mix:9} {name:28} {r['throughput_vs_sglang']:.2f}x SGLang's requests/s, "
                f"p99 {r['p99_vs_sglang']:.2f}x SGLang's"
            )
    for mix, by_side in result.get("targets", {}).items():
        for name, t in by_side.items():
            if t["vs_fastest_contender"] is not None:
                lines.append(
                    f"{mix:9} {name:28} {t['vs_fastest_contender']:.2f}x the fastest other "
                    f"contender's requests/s, cache share {t['share_over_minimal_pts']:+.1f} pts "
                    f"over the minimal controller's: target {'met' if t['met'] else 'missed'}"
                    + (
                        " (adapter: against the controllers in MMEncoder's sequence)"
                        if "adapter" in name
                        else ""
                    )
                )
    if "repeats" in result:
        lines.append(f"medians of {len(result['repeats'])} repeats; spreads in the JSON")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why}")
    return lines


def headline(result: dict[str, Any]) -> str:
    """The README's headline table (markdown): per contender and mix, requests/s and p99 (and
    their ratios to SGLang's controller), encoder tokens saved, the cache's share of request
    time."""
    best = result["config"]["best_policy"]
    mixes = result["mixes"]
    present = next(iter(mixes.values()))
    names = [n for n in contender_names(best) if n in present]
    names += [n for n in present if n not in names]  # an older run's names ("original PR")
    lines = [
        "| contender | "
        + " | ".join(f"{m}: req/s, p99 ms, tokens saved, cache" for m in mixes)
        + " |",
        "| --- |" + " --- |" * len(mixes),
    ]
    for name in names:
        cells = []
        for mix, rows in mixes.items():
            r, theirs = rows[name], rows.get(SGLANG)
            vs = p99 = ""
            if theirs is not None and name != SGLANG:
                vs = f" ({r['requests_per_s'] / theirs['requests_per_s']:.2f}x)"
                p99 = f" ({r['p99_ms'] / theirs['p99_ms']:.2f}x)"
            spread = result.get("spread", {}).get(mix, {}).get(name)
            rps = f"{r['requests_per_s']:.1f}"
            if spread:
                low, high = spread["requests_per_s"]
                rps += f" [{low:.0f}-{high:.0f}]"
            cells.append(
                f"{rps}{vs}, {r['p99_ms']:.0f}{p99}, "
                f"{r['encoder_tokens_saved'] / 1e3:.0f}k, {100 * r['cache_share']:.0f}%"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Requests/s and p99 per contender and mix, as grouped bars (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(result["mixes"])
    names = list(next(iter(result["mixes"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(names)
    for ax, key, label in (
        (axes[0], "requests_per_s", "requests/s"),
        (axes[1], "p99_ms", "p99 ms"),
    ):
        for n, name in enumerate(names):
            values = [result["mixes"][m][name][key] or 0 for m in mixes]
            ax.bar([x + n * width for x in range(len(mixes))], values, width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(mixes))], mixes)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"encode server, {result.get('machine', {}).get('date', '')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    """Where and when the numbers were taken."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(),
        "build": stats_build(),
        "host": platform.node(),
        "cpus": _cpus(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_1min": _load(),
    }


def _commit() -> str | None:
    """The checkout's commit, with "+dirty" when files differ from it (None outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True)
    except OSError:
        return None
    return (head + ("+dirty" if dirty.stdout.strip() else "")) or None


def stats_build() -> str:
    """Which build of embcache's core runs ("compiled" or "pure")."""
    from embcache.core.build import loaded_build

    return loaded_build()


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _load() -> float | None:
    import os

    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full", help="the run's sizes")
    parser.add_argument("--quick", action="store_true", help="same as --size quick")
    parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    parser.add_argument("--requests", type=int, default=None, help="requests per mix")
    parser.add_argument("--best-policy", default=None, help="embcache's policy besides lru")
    parser.add_argument(
        "--seed", type=int, default=None,
        help="the workload's seed (catalog, mixes); at least 0, default the size's",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="measure the mixes this many times; rows are medians, with each figure's spread",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    parser.add_argument(
        "--headline", type=Path, default=None, help="print the README table of this JSON, only"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS),
        help="verify: every contender answers with the encoder's bytes; mixes: the contenders "
        "side by side; breakdown: where each contender's cache time goes (profiled); scale: "
        "embcache at each pool size; fleet: W server processes on one mooncake_master, "
        "without claims, with claims and with hash routing (benchmarks/server/fleet.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.headline:
        print(headline(json.loads(args.headline.read_text())))
        return 0
    config = SIZES["quick" if args.quick else args.size]
    config = replace(config, mixes=tuple(args.mixes))
    if args.requests:
        config = replace(config, requests=args.requests)
    if args.best_policy:
        config = replace(config, best_policy=args.best_policy)
    if args.seed is not None:
        if args.seed < 0:
            parser.error(f"--seed must be at least 0, not {args.seed}")
        config = replace(config, seed=args.seed)
    size = "quick" if args.quick else args.size
    result: dict[str, Any] = {"machine": machine(), "size": size, "config": asdict(config)}
    if "verify" in args.parts:
        result["verify"] = verify(config)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if "mixes" in args.parts:
        runs = []
        for n in range(args.repeats):
            if args.repeats > 1:
                print(f"repeat {n + 1} of {args.repeats}", file=sys.stderr, flush=True)
            runs.append(measure(config))
        result.update(median_of(runs))
        result["headline"] = headline(result)  # the README's table, as --headline prints it
    if "breakdown" in args.parts:
        result["breakdown"] = measure_breakdown(config, result.get("mixes"))
    if "scale" in args.parts:
        result["scale"] = run_scale(config)
    if "fleet" in args.parts:
        result["fleet"] = run_fleet(FLEET_SIZES[size])
    print(table(result))
    if "breakdown" in result:
        print(breakdown.table(result["breakdown"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot and "mixes" in result:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
