"""One encode worker of the fleet-claim tests (tests/mooncake_store/test_mooncake_claims.py).

Run as ``python -m tests.support.claim_worker SPEC`` (SPEC: JSON with ``store``, the
``MooncakeStore`` arguments; ``keys``, the request's image keys; ``encode_s``, seconds per
encoder call; ``lease_s``; ``claims``, on or off). It builds an ``EmbeddingCache`` on a
``MooncakeStore`` that lends no memory (the test process holds the store's memory, so killing a
worker loses nothing stored), prints ``ready``, and on ``go`` (stdin) runs one
``EncodePipeline.encode`` of the keys; the encoder prints ``encoding`` when called, then sleeps.
It prints one JSON line (``exact``: the answer equals ``expected``; ``encoded``; the claim
counters), then waits for ``exit`` so its publish stays readable while the others run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from embcache import EmbeddingCache, Item
from embcache.pipeline import EncodePipeline, FleetClaims
from embcache.store.mooncake import MooncakeStore

ROWS, DIM = 4, 32
SHAPE = (ROWS, DIM)


def expected(key: str) -> torch.Tensor:
    """The one right embedding of ``key``."""
    seed = sum(key.encode()) % 997
    return torch.arange(ROWS * DIM, dtype=torch.float32).reshape(SHAPE) + seed


class SleepyEncoder:
    """An encoder that takes ``encode_s`` per call and uses no CPU; counts what it encodes."""

    device = torch.device("cpu")

    def __init__(self, encode_s: float) -> None:
        self.encode_s = encode_s
        self.encoded = 0

    def __call__(self, inputs: Sequence[Any], /) -> list[torch.Tensor]:
        print("encoding", flush=True)
        time.sleep(self.encode_s)
        self.encoded += len(inputs)
        return [expected(key) for key in inputs]


def main(spec: dict[str, Any]) -> dict[str, Any]:
    keys: list[str] = spec["keys"]
    encoder = SleepyEncoder(spec["encode_s"])
    store = MooncakeStore(**spec["store"], reconnect_interval_s=0.2, claim_lease_s=spec["lease_s"])
    with EmbeddingCache(8 << 20, store=store, pin_memory=False) as cache:
        store.connect()
        claims = FleetClaims(store, poll_s=0.01) if spec["claims"] else None
        pipeline = EncodePipeline(cache, encoder, claims=claims)
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.monotonic()
        answer = pipeline.encode("r", [Item(k, SHAPE, torch.float32) for k in keys], keys)
        seconds = time.monotonic() - started
        want = torch.cat([expected(k) for k in keys])
        result = {
            "exact": bool(torch.equal(answer, want)),
            "encoded": encoder.encoded,
            "seconds": seconds,
            "claims": None if claims is None else asdict(claims.stats()),
        }
        if claims is not None:
            deadline = time.monotonic() + 2 * spec["lease_s"]
            while (
                claims.stats().released + claims.stats().expired
                < claims.stats().claimed + claims.stats().taken_over
            ):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)  # the claim ends after the publish: wait, for the counters
            result["claims"] = asdict(claims.stats())
        print(json.dumps(result), flush=True)
        sys.stdin.readline()
        if claims is not None:
            claims.close()
    store.close()
    return result


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
