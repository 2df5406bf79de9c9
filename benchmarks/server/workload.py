"""What the encode-server benchmark serves: the catalog and request mixes
(``tests/support/server_workload.py``, which the tests check), a metered encoder, the sizes.

``MeteredEncoder`` wraps the encoder (``TinyViT``): it counts images, tokens and seconds, in
total and for the calling thread's current request, so the driver can split a request's time
into encoder time and the rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from embcache.tools.encoders import TinyViT
from tests.support.breakdown import Profiles
from tests.support.server_workload import MIXES


@dataclass
class _Counts:
    images: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class MeteredEncoder:
    """``encoder``, counting images, tokens and seconds: in total and per thread since that
    thread's last ``start_request``. Thread-safe; the encoder runs with no lock held."""

    encoder: TinyViT
    total: _Counts = field(default_factory=_Counts)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _local: threading.local = field(default_factory=threading.local)
    profiles: Profiles | None = None  # set: the encoder's calls are left out of the profile

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    def __call__(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        start = time.perf_counter()
        if self.profiles is None:
            out = self.encoder(pixels)
        else:
            with self.profiles.off():
                out = self.encoder(pixels)
        seconds = time.perf_counter() - start
        tokens = sum(t.shape[0] for t in out)
        mine = self._mine()
        mine.images, mine.tokens, mine.seconds = (
            mine.images + len(out),
            mine.tokens + tokens,
            mine.seconds + seconds,
        )
        with self._lock:
            self.total.images += len(out)
            self.total.tokens += tokens
            self.total.seconds += seconds
        return out

    def start_request(self) -> None:
        """Zero this thread's per-request counts."""
        self._local.counts = _Counts()

    def request_seconds(self) -> float:
        """Encoder seconds of this thread's current request."""
        return self._mine().seconds

    def request_tokens(self) -> int:
        """Tokens encoded for this thread's current request."""
        return self._mine().tokens

    def _mine(self) -> _Counts:
        counts: _Counts | None = getattr(self._local, "counts", None)
        if counts is None:
            counts = self._local.counts = _Counts()
        return counts


@dataclass(frozen=True)
class Config:
    """The run's sizes (``SIZES``)."""

    hidden: int = 1024  # the encoder's output width (bf16)
    hot: int = 1200  # Zipf catalog images
    requests: int = 600  # per mix
    clients: int = 4
    segments: int = 6  # the first warms up
    zipf_s: float = 0.9
    pool_fraction: float = 0.25  # pool bytes / the hot images' bytes
    best_policy: str = "adaptive"  # follows tinylfu or lru, whichever its shadows say hits more
    sglang_page_bytes: int = 256 * 1024  # SGLang's default: 128 tokens of 1024 bf16
    seed: int = 0
    mixes: tuple[str, ...] = MIXES
    scale_pools: tuple[int, ...] = (1 << 30, 4 << 30, 8 << 30)
    scale_hot: int = 300  # images; about 0.35 GiB, so the hot set fits every pool
    scale_requests: int = 400


SIZES = {
    "full": Config(),
    "quick": Config(
        hidden=64,
        hot=80,
        requests=60,
        clients=2,
        segments=3,
        sglang_page_bytes=128 * 64 * 2,
        scale_pools=(8 << 20, 16 << 20, 32 << 20),
        scale_hot=40,
        scale_requests=60,
    ),
    "tiny": Config(  # one client: a smoke run, deterministic
        hidden=32,
        hot=24,
        requests=16,
        clients=1,
        segments=2,
        pool_fraction=0.4,
        sglang_page_bytes=128 * 32 * 2,
        scale_pools=(2 << 20, 4 << 20, 8 << 20),
        scale_hot=12,
        scale_requests=16,
    ),
}
