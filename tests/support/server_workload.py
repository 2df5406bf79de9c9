"""The encode-server benchmark's catalog and request mixes (``benchmarks/server/``), checked by
``tests/test_bench_server.py``.

The catalog holds synthetic images of mixed sizes, 64 to 4096 tokens each after the patch
merger (most of them small, as in chat traffic), their pixels made once and their cache keys
(``image_key``, the hash of the pixels) computed once: every contender receives the same image
objects and keys, so hashing is not part of any contender's time.

A request is 1 to 8 distinct images. The mixes, all over the same catalog:
- ``steady``: image ranks drawn from one Zipf distribution (exponent ``zipf_s``);
- ``drifting``: the same Zipf, but the image at each rank shifts over the run, so that by the
  end the hot set has moved by half the catalog (what was popular goes cold);
- ``scan``: the steady mix where a quarter of the requests are scans, images seen once and
  never again (a crawl, a batch job), which pollute an LRU pool.
The pool is sized as a fraction of the bytes of the hot images, so the hot set does not fit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embcache import Item
from embcache.tools.encoders import TinyViT, image_key, synthetic_image

TOKENS = (64, 144, 256, 576, 1024, 2304, 4096)  # square images: (side / 4) ** 2 tokens
TOKEN_WEIGHTS = (0.24, 0.2, 0.2, 0.16, 0.1, 0.06, 0.04)
MIXES = ("steady", "drifting", "scan")
SCAN_SHARE = 0.25
MAX_IMAGES = 8


def make_encoder(hidden: int) -> TinyViT:
    """The benchmark's encoder: a one-block TinyViT over 2x2-pixel patches with windowed
    attention, so that an image's cost grows with its tokens (a few ms for a typical image)."""
    return TinyViT(
        hidden_size=hidden, patch_size=2, merge=2, width=16, depth=1, heads=2, mlp_ratio=2,
        window=64,
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class Image:
    """One catalog image: its pixels, key and the cache item its embedding fills."""

    pixels: torch.Tensor
    item: Item

    @property
    def key(self) -> str:
        return self.item.key

    @property
    def tokens(self) -> int:
        return self.item.shape[0]

    @property
    def nbytes(self) -> int:
        return self.item.shape[0] * self.item.shape[1] * self.item.dtype.itemsize


def make_images(encoder: TinyViT, count: int, seed: int) -> list[Image]:
    """``count`` images with sizes drawn from ``TOKENS`` by ``TOKEN_WEIGHTS`` (seeded)."""
    rng = random.Random(seed)
    step = encoder.patch_size * encoder.merge
    images = []
    for n in range(count):
        tokens = rng.choices(TOKENS, TOKEN_WEIGHTS)[0]
        side = round(tokens**0.5) * step
        pixels = synthetic_image(seed * 1_000_003 + n, side, side)
        key = image_key(pixels)
        images.append(Image(pixels, Item(key, (tokens, encoder.hidden_size), encoder.dtype)))
    return images


@dataclass(frozen=True)
class Workload:
    """The catalog (hot images first, then scan images) and each mix's requests."""

    images: list[Image]
    hot: int  # images[:hot] are the Zipf catalog, the rest are seen by scans only
    mixes: dict[str, list[list[Image]]]

    def hot_bytes(self) -> int:
        return sum(image.nbytes for image in self.images[: self.hot])


def _zipf_request(rng: random.Random, cum: list[float], size: int) -> list[int]:
    """``size`` distinct ranks drawn by the cumulative weights ``cum``."""
    chosen: dict[int, None] = {}
    while len(chosen) < size:
        chosen.setdefault(rng.choices(range(len(cum)), cum_weights=cum)[0])
    return list(chosen)


def make_workload(
    encoder: TinyViT, hot: int, requests: int, zipf_s: float, seed: int, mixes: Sequence[str]
) -> Workload:
    """A catalog of ``hot`` Zipf images plus the scan images, and ``requests`` per mix."""
    rng = random.Random(seed)
    cum, total = [], 0.0
    for rank in range(hot):
        total += 1.0 / (rank + 1) ** zipf_s
        cum.append(total)
    order = list(range(hot))
    rng.shuffle(order)  # rank -> image, so popularity is independent of size
    sizes = {mix: [rng.randint(1, MAX_IMAGES) for _ in range(requests)] for mix in mixes}
    scans = sum(
        size for n, size in enumerate(sizes.get("scan", [])) if _is_scan(n, seed)
    )  # images that scans see once
    images = make_images(encoder, hot + scans, seed)
    by_mix: dict[str, list[list[Image]]] = {}
    for mix in mixes:
        out, scanned = [], hot
        for n, size in enumerate(sizes[mix]):
            if mix == "scan" and _is_scan(n, seed):
                out.append(images[scanned : scanned + size])
                scanned += size
                continue
            ranks = _zipf_request(rng, cum, size)
            shift = hot * n // (2 * requests) if mix == "drifting" else 0
            out.append([images[order[(r + shift) % hot]] for r in ranks])
        by_mix[mix] = out
    return Workload(images, hot, by_mix)


def _is_scan(n: int, seed: int) -> bool:
    return random.Random(f"{seed}:{n}").random() < SCAN_SHARE
