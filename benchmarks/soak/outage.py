"""Outage soak: the pipeline on a real ``mooncake_master`` killed and restarted, every insert
accounted for.

What runs. ``EncodePipeline`` calls, one thread, on a cache whose store is a real
``mooncake_master`` on loopback (``MooncakeStore``; the default republisher with a bound of
``--max-entries``). Each call asks for ``--new`` keys never asked before (misses: encoded and
inserted, their publish started) and ``--old`` keys of the call before (hits). The encoder's
output for a key is a pure function of the key. Every ``--kill-min-s`` to ``--kill-max-s``
seconds the master is SIGKILLed and started again ``--down-s`` later (it comes back empty); a
store that records each write's per-key result (``Recording``) stands between cache and master.

What it checks, at the end (the master up, the backlog given ``--drain-s`` to empty):
- every call's answer had the encoder's bytes for each key (hit or miss);
- every insert is exactly one of: published (a write of its key ended OK, seen by the store),
  dropped by the bound, still waiting in the backlog, or given up because its entry went
  (stale: evicted before its retry) or its write ended UNKNOWN (quarantined, never retried).
  A retry that the bound dropped while in flight and then ended OK (or UNKNOWN) is in two of
  these at once; such retries are counted (``ended_after_drop``, at most the drops), so the
  sum is exact;
- every key published since the last restart reads back with its bytes (a second worker on
  the same master, at most ``--verify`` keys);
- resident memory after the warm-up (``--warmup-s``) and at the end, after ``gc.collect()``:
  growth under 5%.
Exit status 1 when a check fails. Not a CI test: it runs for minutes. The defaults keep the
rate low enough (a call every ~30 ms) that the lent segment never fills within a master's life,
and the warm-up long enough that the pool and the segment pages the master uses are all
touched before it ends: RSS then measures the cache (at 100 calls/s with 128 MiB lent, the
segment's pages were still being touched after the warm-up: +8.6%, no leak).

Run: MALLOC_ARENA_MAX=2 nice python -m benchmarks.soak.outage [--minutes 10] [--json out.json]
(needs the mooncake extra and ``mooncake_master``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from benchmarks.soak.stress import rss_bytes
from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.driver.backlog import RepublishPolicy
from embcache.driver.global_store import TransferOutcome, put_outcome
from embcache.store.mooncake import MooncakeStore, quiet_native_logging
from embcache.store.mooncake_master import MooncakeMaster, find_master_binary

ROWS, WIDTH = 4, 256  # float32: 4 KiB an item
OK = TransferOutcome.OK
RSS_GROWTH_LIMIT = 0.05


def output(key: str) -> torch.Tensor:
    """The encoder's output for ``key``: its bytes are a hash stream of the key."""
    nbytes = ROWS * WIDTH * 4
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(torch.float32).view(ROWS, WIDTH)


class Encoder:
    device = torch.device("cpu")

    def __call__(self, inputs: list[str]) -> list[torch.Tensor]:
        return [output(key) for key in inputs]


class Recording:
    """A ``GlobalStore`` forwarding to ``inner`` that records, per key, whether a write of it
    ended OK (and in which master life: ``epoch``). Thread-safe."""

    def __init__(self, inner: MooncakeStore) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.epoch = 0  # master lives so far (a restart comes back empty)
        self.published: dict[str, int] = {}  # key -> the epoch its OK write landed in

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self.inner.register_buffer(buffer)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        return self.inner.get_into(keys, offsets, sizes)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        with self._lock:
            epoch = self.epoch
        codes = self.inner.put_from(keys, offsets, sizes)
        ok = [k for k, c in zip(keys, codes, strict=True) if put_outcome(self, c) is OK]
        with self._lock:
            for key in ok:
                self.published.setdefault(key, epoch)
        return codes

    def classify(self, code: int) -> TransferOutcome:
        return self.inner.classify(code)

    def fence(self) -> None:
        self.inner.fence()

    def close(self) -> None:
        self.inner.close()


def soak(args: argparse.Namespace) -> dict[str, Any]:
    quiet_native_logging()
    for name, value in MooncakeMaster.CLIENT_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    rng = random.Random(args.seed)
    prefix = f"outage-{uuid.uuid4().hex[:8]}/"
    with tempfile.TemporaryDirectory(prefix="embcache-outage-") as log_dir, ExitStack() as stack:
        master = MooncakeMaster(find_master_binary(), Path(log_dir))
        master.start()
        stack.callback(master.stop)
        inner = stack.enter_context(
            MooncakeStore(
                **master.store_kwargs(),
                global_segment_size=args.segment_mib << 20,
                key_prefix=prefix,
                reconnect_interval_s=0.1,
            )
        )
        inner.connect()
        store = Recording(inner)
        policy = RepublishPolicy(max_entries=args.max_entries, retry_interval_s=0.5)
        cache = stack.enter_context(
            EmbeddingCache(args.pool_mib << 20, store=store, pin_memory=False, republish=policy)
        )
        pipeline = EncodePipeline(cache, Encoder())
        started = time.monotonic()
        end = started + args.minutes * 60
        next_kill = started + rng.uniform(args.kill_min_s, args.kill_max_s)
        restart_at: float | None = None
        kills = calls = wrong = 0
        previous: list[str] = []
        rss_warm: int | None = None
        while (now := time.monotonic()) < end:
            if restart_at is None and now >= next_kill:
                with inner._swap_lock:  # never under a client setup (benchmarks/soak/stress.py)
                    master.kill()
                kills += 1
                restart_at = now + args.down_s
            elif restart_at is not None and now >= restart_at:
                master.start()
                with store._lock:
                    store.epoch += 1
                restart_at = None
                next_kill = time.monotonic() + rng.uniform(args.kill_min_s, args.kill_max_s)
            if rss_warm is None and now - started >= args.warmup_s:
                gc.collect()
                rss_warm = rss_bytes()
            keys = [f"k{calls}-{i}" for i in range(args.new)] + previous[: args.old]
            items = [Item(key, (ROWS, WIDTH), torch.float32) for key in keys]
            answer = pipeline.encode(f"call-{calls}", items, keys)
            for n, key in enumerate(keys):
                got = answer[n * ROWS : (n + 1) * ROWS].view(torch.uint8)
                wrong += not torch.equal(got, output(key).view(torch.uint8))
            calls += 1
            previous = keys[: args.new]
            time.sleep(args.pause_s)
        if restart_at is not None:
            master.start()
            with store._lock:
                store.epoch += 1
        deadline = time.monotonic() + args.drain_s
        while time.monotonic() < deadline and not settled(cache):
            time.sleep(0.1)
        stats = cache.stats()
        inserted = stats.inserts  # each started one publish (retries are no inserts)
        gc.collect()
        rss_end = rss_bytes()
        published = len(store.published)
        given_up = stats.publish_backlog_dropped + stats.publish_backlog_stale
        unknown = stats.publishes_unknown
        waiting = stats.publish_backlog
        # a retry dropped in flight that then ended OK or UNKNOWN is in two of the counts
        after_drop = published + given_up + unknown + waiting - inserted
        verified, bad = verify(master, args, store, prefix)
    rss_warm = rss_warm or rss_end
    result = {
        "minutes": args.minutes,
        "calls": calls,
        "inserts": inserted,
        "master_kills": kills,
        "published": published,
        "dropped_by_the_bound": stats.publish_backlog_dropped,
        "stale": stats.publish_backlog_stale,
        "unknown_quarantined": unknown,
        "still_waiting": waiting,
        "ended_after_drop": after_drop,
        "publishes_ok_failed_unknown": [
            stats.publishes_ok,
            stats.publishes_failed,
            stats.publishes_unknown,
        ],
        "wrong_answers": wrong,
        "verified_from_the_store": verified,
        "wrong_bytes_in_the_store": bad,
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth": round(rss_end / rss_warm - 1, 4),
    }
    result["checks"] = {
        "no wrong answer": wrong == 0,
        "every insert accounted for once": 0 <= after_drop <= stats.publish_backlog_dropped,
        "no wrong bytes in the store": bad == 0,
        "the store was killed": kills > 0,
        "RSS flat after the warm-up": result["rss_growth"] < RSS_GROWTH_LIMIT,
    }
    return result


def settled(cache: EmbeddingCache) -> bool:
    s = cache.stats()
    ended = s.publishes_ok + s.publishes_failed + s.publishes_unknown
    return s.publish_backlog == 0 and s.publishes_started == ended


def verify(
    master: MooncakeMaster, args: argparse.Namespace, store: Recording, prefix: str
) -> tuple[int, int]:
    """Read keys published in the master's current life back through a second worker."""
    keys = [k for k, epoch in store.published.items() if epoch == store.epoch][-args.verify :]
    bad = 0
    with ExitStack() as stack:
        reader = stack.enter_context(
            MooncakeStore(
                **master.store_kwargs(),
                global_segment_size=0,
                key_prefix=prefix,
                reconnect_interval_s=0.1,
            )
        )
        cache = stack.enter_context(
            EmbeddingCache(64 << 20, store=reader, pin_memory=False, republish=None)
        )
        reader.connect()
        for i in range(0, len(keys), 64):
            batch = keys[i : i + 64]
            with cache.request(f"verify-{i}") as request:
                request.lookup([Item(k, (ROWS, WIDTH), torch.float32) for k in batch])
                request.wait(30)
                for key, view in zip(batch, request.embeddings(), strict=True):
                    want = output(key).view(torch.uint8)  # (bytes: random floats hold NaNs)
                    bad += view is None or not torch.equal(view.view(torch.uint8), want)
            cache.clear()
    return len(keys), bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-min-s", type=float, default=30.0)
    parser.add_argument("--kill-max-s", type=float, default=60.0)
    parser.add_argument("--down-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--drain-s", type=float, default=30.0)
    parser.add_argument("--new", type=int, default=3)
    parser.add_argument("--old", type=int, default=1)
    parser.add_argument("--pause-s", type=float, default=0.03)
    parser.add_argument("--pool-mib", type=int, default=16)
    parser.add_argument("--segment-mib", type=int, default=32)
    parser.add_argument("--max-entries", type=int, default=1024)
    parser.add_argument("--verify", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = soak(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
