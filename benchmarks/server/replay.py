"""The server benchmark's trace replayed one request at a time, with no encoder run: each
policy's encoder time, and the original PR's controller's, on the same requests.

``bench_server`` serves its mixes with four client threads and a real encoder, so one run
takes minutes and its tokens saved move a few percent with the threads' interleaving. This
replays the same trace (``make_workload``, same sizes and seed) through each cache in order,
one request at a time, and charges each miss the encoder's measured time for one image of its
size (``encoder_costs``: the benchmark's TinyViT costs about 0.7 ms an image plus 7.5 us a
token, so small images cost more a token than large ones). It answers which policy would save
the most encoder time on the server's workload without the threads' noise, in a minute or two.

Each embcache request is ``lookup(reserve_misses=True)``, then one ``insert`` of its misses
(zero tensors of the right shape), as ``EncodePipeline`` does. ``adaptive-work`` runs twice:
``rows`` shares the request's encoder time over its misses by rows, as the pipeline does;
``own cost`` gives each miss its own measured cost (what a perfect per-item measurement would
give); their decisions follow the costs measured in the run, so they vary a little from run
to run where the others' do not. The original PR's controller is
``tests.support.baselines.OriginalPRController``, called as ``bench_server``'s
``OriginalPRServer`` calls it. The first segment of each mix warms up,
as in ``bench_server``.

    python -m benchmarks.server.replay [--size full] [--requests 2000] [--seed 0] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from benchmarks.server.workload import SIZES
from embcache import EmbeddingCache
from embcache.core.policy import Policy
from tests.support.baselines import OriginalPRController
from tests.support.server_workload import TOKENS, Image, make_encoder, make_images, make_workload

ORIGINAL = "original PR"
CONTENDERS = ("lru", "tinylfu", "adaptive", "adaptive-work (rows)", "adaptive-work (own cost)")


@dataclass
class Tally:
    """What one cache cost and saved over the measured requests."""

    encoder_s: float = 0.0  # the measured cost of every image it encoded
    images: int = 0  # images encoded
    tokens_encoded: int = 0
    tokens_saved: int = 0  # requested tokens not encoded (a hit, or a key repeated in a request)


def encoder_costs(encoder: Any, seed: int, repeats: int = 5) -> dict[int, float]:
    """Seconds the encoder takes for one image of each size in ``TOKENS``: the median of
    ``repeats`` calls after one warm-up call."""
    by_size: dict[int, Image] = {}
    for image in make_images(encoder, 40 * len(TOKENS), seed):
        by_size.setdefault(image.tokens, image)
    costs = {}
    with torch.no_grad():
        for tokens, image in sorted(by_size.items()):
            encoder([image.pixels])
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                encoder([image.pixels])
                times.append(time.perf_counter() - started)
            costs[tokens] = statistics.median(times)
    return costs


class _Zeros:
    """One zero tensor per item shape, reused for every insert of that shape."""

    def __init__(self) -> None:
        self._made: dict[tuple[Any, ...], torch.Tensor] = {}

    def __call__(self, image: Image) -> torch.Tensor:
        shape, dtype = image.item.shape, image.item.dtype
        made = self._made.get((shape, dtype))
        if made is None:
            made = self._made[shape, dtype] = torch.zeros(shape, dtype=dtype)
        return made


def replay_original(
    trace: list[list[Image]], warm: int, pool_bytes: int, costs: dict[int, float]
) -> Tally:
    """The original PR's controller: which keys exist, views of those (pinned), the rest
    encoded and inserted one by one, the views released."""
    controller, zeros, tally = OriginalPRController(pool_bytes), _Zeros(), Tally()
    for n, images in enumerate(trace):
        keys = [image.key for image in images]
        found = controller.batch_is_exist(keys)
        hits = [key for key, there in zip(keys, found, strict=True) if there]
        held: set[str] = set()
        if hits:
            controller.prefetch(str(n), hits)
            controller.check_prefetch_progress(str(n))
            views = controller.get_pool_views(hits)
            held = {key for key, view in zip(hits, views, strict=True) if view is not None}
        encoded: set[str] = set()
        for image in images:
            if image.key in held or image.key in encoded:
                tally.tokens_saved += image.tokens if n >= warm else 0
                continue
            encoded.add(image.key)
            if n >= warm:
                tally.encoder_s += costs[image.tokens]
                tally.images += 1
                tally.tokens_encoded += image.tokens
            controller.insert(image.key, zeros(image))
        if held:
            controller.release_pool_views(list(held))
    return tally


def replay_embcache(
    trace: list[list[Image]],
    warm: int,
    pool_bytes: int,
    costs: dict[int, float],
    name: str,
    policy: Policy | None = None,
) -> Tally:
    """An ``EmbeddingCache`` with the contender's policy (``policy``, when given, in place of
    the one ``name`` names): each request one lookup that reserves its misses, then one insert
    of them with their work where the contender passes work."""
    named, _, work = name.partition(" ")
    chosen = named if policy is None else policy
    cache, zeros, tally = EmbeddingCache(pool_bytes, policy=chosen), _Zeros(), Tally()
    try:
        for n, images in enumerate(trace):
            request, _ = cache.lookup(str(n), [image.item for image in images], reserve_misses=True)
            with request:
                misses: dict[str, Image] = {}
                for image, offset in zip(images, request.offsets(), strict=True):
                    if offset is not None or image.key in misses:
                        tally.tokens_saved += image.tokens if n >= warm else 0
                    else:
                        misses[image.key] = image
                if not misses:
                    continue
                fresh = list(misses.values())
                seconds = [costs[image.tokens] for image in fresh]
                if n >= warm:
                    tally.encoder_s += sum(seconds)
                    tally.images += len(fresh)
                    tally.tokens_encoded += sum(image.tokens for image in fresh)
                if work == "(rows)":
                    rows = sum(image.tokens for image in fresh)
                    seconds = [sum(seconds) * image.tokens / rows for image in fresh]
                request.insert(
                    [image.key for image in fresh],
                    [zeros(image) for image in fresh],
                    publish=False,
                    work=seconds if work else None,
                )
    finally:
        cache.close()
    return tally


def run(
    size: str, seed: int, mixes: Sequence[str] | None = None, requests: int | None = None
) -> dict[str, Any]:
    """Every contender on every mix: the report ``main`` prints and writes."""
    config = replace(
        SIZES[size],
        seed=seed,
        mixes=tuple(mixes or SIZES[size].mixes),
        requests=requests or SIZES[size].requests,
    )
    torch.set_num_threads(1)
    encoder = make_encoder(config.hidden)
    workload = make_workload(  # every mix, in bench_server's order: each mix's trace is its
        encoder, config.hot, config.requests, config.zipf_s, config.seed, SIZES[size].mixes
    )  # trace there (the mixes draw from one generator, so a subset would draw others)
    pool_bytes = int(config.pool_fraction * workload.hot_bytes()) // 4096 * 4096
    costs = encoder_costs(encoder, seed)
    rows: dict[str, dict[str, Any]] = {}
    for mix in config.mixes:
        trace = workload.mixes[mix]
        warm = -(-len(trace) // config.segments)
        tallies = {ORIGINAL: replay_original(trace, warm, pool_bytes, costs)}
        for name in CONTENDERS:
            tallies[name] = replay_embcache(trace, warm, pool_bytes, costs, name)
        requested = sum(image.tokens for images in trace[warm:] for image in images)
        base = tallies[ORIGINAL].encoder_s
        rows[mix] = {
            name: {
                **asdict(t),
                "requested_tokens": requested,
                "vs_original_pr": t.encoder_s / base if base else None,
            }
            for name, t in tallies.items()
        }
    return {"config": asdict(config), "pool_bytes": pool_bytes, "costs": costs, "mixes": rows}


def table(report: dict[str, Any]) -> str:
    """One line per mix and contender."""
    lines = ["encoder ms per image size: " + ", ".join(
        f"{tokens}: {1e3 * s:.2f}" for tokens, s in report["costs"].items()
    )]  # fmt: skip
    lines.append(f"{'mix':<9} {'contender':<26} {'encoder s':>9} {'vs orig':>8} "
                 f"{'tokens saved':>12} {'images':>7}")  # fmt: skip
    for mix, rows in report["mixes"].items():
        for name, r in rows.items():
            ratio = "" if r["vs_original_pr"] is None else f"{r['vs_original_pr']:.3f}x"
            lines.append(
                f"{mix:<9} {name:<26} {r['encoder_s']:9.2f} {ratio:>8} "
                f"{r['tokens_saved']:12d} {r['images']:7d}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full", help="bench_server's sizes")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (at least 0)")
    parser.add_argument("--mixes", nargs="+", choices=SIZES["full"].mixes, default=None)
    parser.add_argument("--requests", type=int, default=None, help="per mix (the size's)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be at least 0, not {args.seed}")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be at least 1, not {args.requests}")
    report = run(args.size, args.seed, args.mixes, args.requests)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
