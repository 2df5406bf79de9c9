"""A fleet of W encode workers on one ``mooncake_master``: duplicate encodes, with and without
fleet claims.

Setup. For each W (2 and 4) and each contender, one real local ``mooncake_master`` (claim
lease ``--put_start_discard_timeout_sec`` = ``lease_s``), one store client in this process
that lends the store its memory, and W worker processes. Each worker has its own
``EmbeddingCache`` (the best policy; a pool of ``pool_fraction`` of the hot images' bytes) on a
``MooncakeStore`` of that master, an ``EncodePipeline`` and ``clients`` client threads. The
workers run every mix in turn (keys namespaced by mix, each mix from a cold cache), starting
together.

Encoder. This machine has two cores, so W real encoders cannot run at once: the encoder here
takes ``per_token_s`` seconds per token and sleeps that long, using no CPU (it stands in for an
accelerator: one per worker, one call at a time, so a worker's encodes queue as on a GPU and a
duplicate encode costs the fleet device time). Its output for an image is a constant (a small
integer from the key's CRC-32, exact in bf16), so every answer is checked row by row: a wrong
answer is a request with any row that is not its image's constant.

Requests. The server benchmark's three mixes (``steady``, ``drifting``, ``scan``; catalog and
mixes of ``tests/support/server_workload.py``) and ``burst``: rounds of 2·W requests that each
carry one image never seen before, first, plus up to two Zipf catalog images, so each new image
reaches several workers within one encode time. Contenders:
- ``no claims``: requests spread at random over the workers (seeded), no claims: an image a
  worker's pool refuses is encoded there every time and never published;
- ``claims``: the same spread, ``EncodePipeline(claims=FleetClaims(store))``: refused images
  are claimed too, published as copies and read as copies (``copied``, ``read_copies``);
- ``hash routing``: each request to the worker ``crc32(first image key) % W``, no claims.

Rows, per W, contender and mix: encodes per distinct image (1.0 is the floor), duplicate
encodes (encodes beyond the first of each key, fleet-wide), cross-worker duplicates (per key,
the workers that encoded it beyond the first: what claims remove; the rest are re-encodes in one
worker of images its pool refused or dropped, that nobody published), requests/s (all requests
over the slowest worker's time), p50 and p99 latency (ms, every request of the fleet), bytes
through the store (read by loads and copies, offered by publishes and copies), wrong answers,
and the claim counters.

Size. ``full`` sends 320 requests per mix (160 left rows a few duplicates apart); it takes
about 3.5 minutes (206 s at load 2.5-7 on the 2-core machine).

    python -m benchmarks.server.fleet [--size quick|tiny] [--out FILE]
    python -m benchmarks.server.fleet --table FILE    # a result's rows as markdown
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from embcache import EmbeddingCache, Item
from embcache.pipeline import EncodePipeline, FleetClaims
from tests.support.server_workload import MIXES, Image, make_encoder, make_images, make_workload

CONTENDERS = ("no claims", "claims", "hash routing")
BURST = "burst"


@dataclass(frozen=True)
class FleetConfig:
    """The run's sizes."""

    workers: tuple[int, ...] = (2, 4)
    hidden: int = 64  # the row width (bf16): 128 bytes a token
    hot: int = 300  # Zipf catalog images
    requests: int = 320  # per mix (160 left rows a few duplicates apart: noise)
    clients: int = 2  # client threads per worker
    per_token_s: float = 20e-6  # the encoder's time per token (slept: no CPU)
    zipf_s: float = 0.9
    pool_fraction: float = 0.25
    policy: str = "adaptive"
    lease_s: int = 10
    seed: int = 0
    mixes: tuple[str, ...] = (BURST, *MIXES)


SIZES = {
    "full": FleetConfig(),
    "quick": FleetConfig(hot=120, requests=64),
    "tiny": FleetConfig(workers=(2,), hot=24, requests=16, mixes=(BURST, "steady")),
}


def value_of(key: str) -> int:
    """The constant every row of ``key``'s embedding holds (exact in bf16)."""
    return zlib.crc32(key.encode()) % 201 - 100


class SleepingEncoder:
    """One accelerator: takes ``per_token_s`` per token, asleep (no CPU), one call at a time
    (a worker's calls queue for its device, as on a GPU); counts the keys it encodes."""

    device = torch.device("cpu")

    def __init__(self, per_token_s: float) -> None:
        self.per_token_s = per_token_s
        self.encoded: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._device = threading.Lock()  # the accelerator: held only across the sleep

    def __call__(self, inputs: Sequence[Item], /) -> list[torch.Tensor]:
        with self._device:
            time.sleep(self.per_token_s * sum(item.shape[0] for item in inputs))
        with self._lock:
            self.encoded.update(item.key for item in inputs)
        return [torch.full(item.shape, value_of(item.key), dtype=item.dtype) for item in inputs]


class CountingStore:
    """A ``MooncakeStore`` that counts the bytes its loads read and its publishes offer."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.read = 0
        self.offered = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    @property
    def claim_lease_s(self) -> float:
        return float(self.store.claim_lease_s)

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self.store.register_buffer(buffer)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self.store.exists(keys))

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        codes: list[int] = self.store.get_into(keys, offsets, sizes)
        with self._lock:
            self.read += sum(n for c, n in zip(codes, sizes, strict=True) if c == n)
        return codes

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        codes: list[int] = self.store.put_from(keys, offsets, sizes)
        with self._lock:
            self.offered += sum(n for c, n in zip(codes, sizes, strict=True) if c == 0)
        return codes

    def classify(self, code: int) -> Any:
        return self.store.classify(code)

    def fence(self) -> None:
        self.store.fence()

    def close(self) -> None:
        self.store.close()

    def claim(self, keys: Sequence[str]) -> list[int]:
        return list(self.store.claim(keys))

    def put_copies(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[int]:
        codes: list[int] = self.store.put_copies(keys, values)
        with self._lock:
            self.offered += sum(v.nbytes for c, v in zip(codes, values, strict=True) if c == 0)
        return codes

    def get_copies(self, keys: Sequence[str], sizes: Sequence[int]) -> list[torch.Tensor | None]:
        got: list[torch.Tensor | None] = self.store.get_copies(keys, sizes)
        with self._lock:
            self.read += sum(t.nbytes for t in got if t is not None)
        return got

    def release(self, keys: Sequence[str]) -> list[int]:
        return list(self.store.release(keys))


# ---------------------------------------------------------------------------------------------
# The requests


def make_mixes(config: FleetConfig, w: int) -> dict[str, list[list[Image]]]:
    """Each mix's requests (the same in every process: seeded)."""
    encoder = make_encoder(config.hidden)
    plain = [m for m in config.mixes if m != BURST]
    work = make_workload(encoder, config.hot, config.requests, config.zipf_s, config.seed, plain)
    mixes = dict(work.mixes)
    if BURST in config.mixes:
        rounds = max(1, config.requests // (2 * w))
        fresh = make_images(encoder, rounds, config.seed + 7919)
        rng = random.Random(config.seed)
        hot = work.images[: work.hot]
        mixes[BURST] = [
            [fresh[r], *rng.sample(hot, rng.randint(0, 2))]
            for r in range(rounds)
            for _ in range(2 * w)
        ]
    return {m: mixes[m] for m in config.mixes}


def route(contender: str, requests: list[list[Image]], w: int, seed: int) -> list[int]:
    """The worker of each request."""
    if contender == "hash routing":
        return [zlib.crc32(images[0].key.encode()) % w for images in requests]
    rng = random.Random(seed)
    return [rng.randrange(w) for _ in requests]


# ---------------------------------------------------------------------------------------------
# A worker process


def _worker(spec: dict[str, Any]) -> None:
    """Serve this rank's share of each mix on ``go``; print one JSON line per mix."""
    from embcache.store.mooncake import MooncakeStore

    torch.set_num_threads(1)
    config = _config(spec["config"])
    w, rank, contender = spec["w"], spec["rank"], spec["contender"]
    mixes = make_mixes(config, w)
    hot_bytes = sum(
        i.nbytes for i in make_images(make_encoder(config.hidden), config.hot, config.seed)
    )
    pool = max(1 << 20, int(config.pool_fraction * hot_bytes) // 4096 * 4096)
    raw = MooncakeStore(**spec["store"], claim_lease_s=config.lease_s, reconnect_interval_s=0.2)
    raw.connect()
    store = CountingStore(raw)
    encoder = SleepingEncoder(config.per_token_s)
    with EmbeddingCache(pool, store=store, policy=config.policy) as cache:
        claims = FleetClaims(store) if contender == "claims" else None  # type: ignore[arg-type]
        pipeline = EncodePipeline(cache, encoder, claims=claims)
        print("ready", flush=True)
        for mix, requests in mixes.items():
            sys.stdin.readline()
            mine = [
                (n, images)
                for n, (images, to) in enumerate(
                    zip(
                        requests, route(contender, requests, w, config.seed + len(mix)), strict=True
                    )
                )
                if to == rank
            ]
            result = _serve(pipeline, encoder, store, claims, mix, mine, config.clients)
            cache.clear()
            print(json.dumps(result), flush=True)
        sys.stdin.readline()
        if claims is not None:
            claims.close()
    raw.close()


def _serve(
    pipeline: EncodePipeline,
    encoder: SleepingEncoder,
    store: CountingStore,
    claims: FleetClaims | None,
    mix: str,
    mine: list[tuple[int, list[Image]]],
    clients: int,
) -> dict[str, Any]:
    encoder.encoded.clear()
    store.read = store.offered = 0
    before = asdict(claims.stats()) if claims is not None else {}
    jobs = iter(mine)
    lock = threading.Lock()
    latencies: list[float] = []
    wrong = [0]

    def client() -> None:
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            n, images = job
            items = [Item(f"{mix}/{i.key}", i.item.shape, i.item.dtype) for i in images]
            began = time.perf_counter()
            try:
                out = pipeline.encode(f"{mix}-{n}", items, items)
                ok = _exact(out, items)
            except Exception:
                ok = False
            seconds = time.perf_counter() - began
            with lock:
                latencies.append(seconds)
                wrong[0] += not ok

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    after = asdict(claims.stats()) if claims is not None else {}
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "latencies": latencies,
        "encoded": dict(encoder.encoded),
        "wrong": wrong[0],
        "read_bytes": store.read,
        "offered_bytes": store.offered,
        "claims": {k: after[k] - before[k] for k in after},
    }


def _exact(out: torch.Tensor, items: list[Item]) -> bool:
    at = 0
    for item in items:
        rows = out[at : at + item.shape[0]]
        if rows.shape != item.shape or not bool((rows == value_of(item.key)).all()):
            return False
        at += item.shape[0]
    return at == out.shape[0]


# ---------------------------------------------------------------------------------------------
# The driver


def run_fleet(config: FleetConfig) -> dict[str, Any]:
    """Every row: for each W and contender, every mix."""
    from embcache.store.mooncake_master import master_binary

    if master_binary() is None:
        return {"rows": [], "skipped": "mooncake_master is not installed"}
    rows = []
    for w in config.workers:
        mixes = make_mixes(config, w)
        distinct = {m: len({i.key for r in reqs for i in r}) for m, reqs in mixes.items()}
        for contender in CONTENDERS:
            for mix, each in _run_contender(config, w, contender).items():
                rows.append(_row(w, contender, mix, distinct[mix], each))
    return {"rows": rows}


def _run_contender(config: FleetConfig, w: int, contender: str) -> dict[str, list[dict[str, Any]]]:
    """W workers on a fresh master: each mix's per-worker results."""
    from embcache.store.mooncake import MooncakeStore
    from embcache.store.mooncake_master import MooncakeMaster

    with MooncakeMaster(claim_lease_s=config.lease_s) as master:
        lender = MooncakeStore(**master.store_kwargs(), global_segment_size=1 << 30)
        lender.connect()
        env = {**os.environ, **MooncakeMaster.CLIENT_ENVIRONMENT}
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        procs = []
        try:
            for rank in range(w):
                spec = {"config": asdict(config), "w": w, "rank": rank, "contender": contender,
                        "store": master.store_kwargs()}  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "benchmarks.server.fleet",
                            "--worker",
                            json.dumps(spec),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        env=env,
                    )
                )
            for proc in procs:
                _expect(proc, "ready")
            out: dict[str, list[dict[str, Any]]] = {}
            for mix in config.mixes:
                for proc in procs:
                    assert proc.stdin is not None
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                out[mix] = [json.loads(_line(proc)) for proc in procs]
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("exit\n")
                proc.stdin.flush()
            for proc in procs:
                proc.wait(timeout=120)
                if proc.returncode:
                    raise RuntimeError(f"a worker failed (exit {proc.returncode})")
            return out
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            lender.close()


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a worker ended early (exit {proc.wait()})")
    return line


def _expect(proc: subprocess.Popen[str], word: str) -> None:
    line = _line(proc).strip()
    if line != word:
        raise RuntimeError(f"a worker said {line!r}, not {word!r}")


def _row(
    w: int, contender: str, mix: str, distinct: int, each: list[dict[str, Any]]
) -> dict[str, Any]:
    encoded: Counter[str] = Counter()
    workers: Counter[str] = Counter()  # per key: how many workers encoded it
    for e in each:
        encoded.update(e["encoded"])
        workers.update(e["encoded"].keys())
    latencies = sorted(x for e in each for x in e["latencies"])
    requests = sum(e["requests"] for e in each)
    claims: Counter[str] = Counter()
    for e in each:
        claims.update(e["claims"])
    return {
        "W": w,
        "contender": contender,
        "mix": mix,
        "distinct_images": distinct,
        "encodes": sum(encoded.values()),
        "encodes_per_image": round(sum(encoded.values()) / distinct, 3),
        "duplicate_encodes": sum(encoded.values()) - len(encoded),
        "cross_worker_duplicates": sum(workers.values()) - len(workers),
        "requests": requests,
        "requests_per_s": round(requests / max(e["seconds"] for e in each), 1),
        "p50_ms": round(1e3 * statistics.median(latencies), 2),
        "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
        "store_mb": round(sum(e["read_bytes"] + e["offered_bytes"] for e in each) / 1e6, 2),
        "wrong_answers": sum(e["wrong"] for e in each),
        "claims": dict(claims),
    }


def _config(fields: dict[str, Any]) -> FleetConfig:
    return FleetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _header(config: FleetConfig, size: str) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "commit": commit,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "load": os.getloadavg(),
        "size": size,
        "config": asdict(config),
    }


def table(result: dict[str, Any]) -> str:
    """The rows of a result as a markdown table (docs/benchmarks.md)."""
    lines = [
        "| W | mix | contender | encodes/image | duplicates (cross-worker) | req/s | p50 ms "
        "| p99 ms | store MB | wrong |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {name: n for n, name in enumerate(CONTENDERS)}
    rows = sorted(result["rows"], key=lambda r: (r["W"], r["mix"], order[r["contender"]]))
    for r in rows:
        lines.append(
            f"| {r['W']} | {r['mix']} | {r['contender']} | {r['encodes_per_image']:.3f} "
            f"| {r['duplicate_encodes']} ({r['cross_worker_duplicates']}) "
            f"| {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
            f"| {r['store_mb']:.1f} | {r['wrong_answers']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full", help="the run's sizes")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--table", default=None, help="print a result JSON's markdown table")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return 0
    if args.table is not None:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    config = SIZES[args.size]
    header = _header(config, args.size)
    result = {**header, **run_fleet(config), "load_after": os.getloadavg()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
