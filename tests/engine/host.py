"""One real vLLM engine in its own process, driven by the engine tier over a pipe.

The engine is vLLM's ``LLM`` with the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler, the model runner and both roles of
the connector live here and can be counted: the identifiers the scheduler sent to the encoder
(``encoded``), the images that went through the vision tower (``vision_images``, a forward hook
on it), the connector's ``SchedulerStats`` and its cache's ``CacheStats``. With the
multiprocessing executor (``--engine-args '{"distributed_executor_backend": "mp", ...}'``) the
model runner and the worker-role connectors run in vLLM's worker processes (``workers``: their
pids by rank) and ``vision_images`` stays 0; the scheduler and its connector stay here.

Requests come as JSON lines on stdin, answers go as JSON lines to the file descriptor
``--reply-fd``; vLLM's own output goes to stdout and stderr (the tier sends them to a log).
Operations: ``generate`` (prompts of words and image numbers, greedy), ``serve`` (the same
in a closed loop of a few clients, timed), ``stats``, ``check``
(the connector's ``check_invariants``), ``ranks`` (what the scheduler knows of its ranks: the
workers it watches, the deaths it learned, its holds and sizes, the states of some keys; and
the identifiers encoded so far, and when ``generate(kill=...)`` killed a worker),
``fence`` (the cache's fence, then ``ranks``), ``shutdown`` (vLLM's own shutdown of the engine
core, as its failure path ends: the executor, then the scheduler and its connector; then
``ranks``), ``quit``.

    python -m tests.engine.host --model DIR --reply-fd N [--ec JSON] [--engine-args JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

MAX_MODEL_LEN = 256


class Engine:
    """The engine and its counters."""

    def __init__(self, model: str, ec: dict[str, Any] | None, overrides: dict[str, Any]) -> None:
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "max_num_seqs": 32,
            "max_num_batched_tokens": 2048,
            "limit_mm_per_prompt": {"image": 2},
            **overrides,
        }
        if ec is not None:
            kwargs["ec_transfer_config"] = ec
        self.llm = LLM(
            model=model,
            tokenizer=model,
            runner="generate",
            model_impl="vllm",
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            seed=0,
            disable_log_stats=True,
            **kwargs,
        )
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.connector = self.scheduler.ec_connector
        self.encoded: list[str] = []
        self.vision_images = 0
        self._served = 0
        self._kill: list[int] | None = None  # [rank, steps left before its worker is killed]
        self.killed_at: float | None = None
        self._wrap_schedule()
        executor = core.model_executor
        self.workers = {h.rank: h.proc.pid for h in getattr(executor, "workers", None) or ()}
        driver = getattr(executor, "driver_worker", None)
        if driver is not None:  # the model runs in this process
            model_obj = driver.worker.model_runner.get_model()
            model_obj.vision_tower.register_forward_hook(self._count_images)

    def _wrap_schedule(self) -> None:
        schedule = self.scheduler.schedule

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            for req_id, indexes in out.scheduled_encoder_inputs.items():
                features = self.scheduler.requests[req_id].mm_features
                self.encoded.extend(features[i].identifier for i in indexes)
            if self._kill is not None:
                self._kill_when_due()
            return out

        self.scheduler.schedule = counted

    def _kill_when_due(self) -> None:
        """Count a scheduled step of ``generate(kill=...)``; at the due one, once the scheduler
        built it and before the executor runs it, SIGKILL the rank's worker process and wait
        until it has exited (``killed_at``: this process's monotonic clock at the kill)."""
        assert self._kill is not None
        self._kill[1] -= 1
        if self._kill[1] > 0:
            return
        from tests.support.engines import running

        pid = self.workers[self._kill[0]]
        self._kill = None
        self.killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def _count_images(self, module: Any, inputs: Any, output: Any) -> None:
        self.vision_images += int(inputs[0].shape[0])

    @staticmethod
    def _prompts(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from tests.engine.tiny_llava import images

        prompts = []
        for r in requests:
            pics = [images(1, offset=i)[0] for i in r["images"]]
            text = " ".join(["<image>"] * len(pics) + r["words"])
            prompt: dict[str, Any] = {"prompt": text}
            if pics:
                prompt["multi_modal_data"] = {"image": pics}
            prompts.append(prompt)
        return prompts

    def generate(
        self, requests: list[dict[str, Any]], max_tokens: int, kill: list[int] | None = None
    ) -> dict[str, Any]:
        """Greedy answers to ``requests``; ``kill`` ``[rank, n]``: SIGKILL that rank's worker
        process right after the ``n``-th step of this call is scheduled (``_kill_when_due``)."""
        from vllm import SamplingParams

        self._kill = None if kill is None else list(kill)
        prompts = self._prompts(requests)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, ignore_eos=True)
        before_encoded, before_images = len(self.encoded), self.vision_images
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "encoded": self.encoded[before_encoded:],
            "vision_images": self.vision_images - before_images,
            **self.stats(),
        }

    def serve(
        self, requests: list[dict[str, Any]], clients: int, max_tokens: int
    ) -> dict[str, Any]:
        """A closed loop over ``requests`` in order: ``clients`` requests in flight, the next
        one added as soon as one finishes (one engine step at a time). Per request: its greedy
        answer and its latency (added to finished, seconds); the loop's wall time and the
        process's CPU time in it (every thread); the images through the vision tower; the
        process's peak RSS (KiB, since it started)."""
        import resource

        from vllm import SamplingParams

        prompts = self._prompts(requests)  # images made before the clock starts
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, ignore_eos=True)
        engine = self.llm.llm_engine
        tokens: list[list[int]] = [[] for _ in prompts]
        latency = [0.0] * len(prompts)
        flying: dict[str, tuple[int, float]] = {}
        before_encoded, before_images = len(self.encoded), self.vision_images
        self._served += 1
        added, start, cpu = 0, time.perf_counter(), time.process_time()
        while added < len(prompts) or flying:
            while added < len(prompts) and len(flying) < clients:
                name = f"serve{self._served}-{added}"
                got = engine.add_request(name, prompts[added], params)
                flying[got] = flying[name] = (added, time.perf_counter())
                added += 1
            for out in engine.step():
                if out.finished and out.request_id in flying:
                    index, began = flying.pop(out.request_id)
                    flying = {k: v for k, v in flying.items() if v[0] != index}
                    latency[index] = time.perf_counter() - began
                    tokens[index] = list(out.outputs[0].token_ids)
        return {
            "tokens": tokens,
            "latency_s": latency,
            "wall_s": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu,
            "encoded": len(self.encoded) - before_encoded,
            "vision_images": self.vision_images - before_images,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            **self.stats(),
        }

    def stats(self) -> dict[str, Any]:
        import embcache

        out: dict[str, Any] = {
            "pid": os.getpid(),
            "workers": self.workers,
            "embcache": embcache.__file__,
            "vision_images_total": self.vision_images,
        }
        if self.connector is not None and hasattr(self.connector, "stats"):
            out["connector"] = asdict(self.connector.stats())
            cache = self.connector.scheduler_side.cache
            out["cache"] = {k: v for k, v in asdict(cache.stats()).items() if _plain(v)}
        return out

    def check(self) -> dict[str, Any]:
        if self.connector is not None:
            self.connector.check_invariants()
        return {"checked": self.connector is not None}

    def ranks(self, keys: list[str] = []) -> dict[str, Any]:  # noqa: B006 (never changed)
        """What the scheduler-role connector knows of its ranks, now: the worker processes it
        watches (``workers()``), the deaths it learned (``deaths()``), its holds and sizes, its
        cache's pins, and the entry state of each of ``keys``; ``now`` is this process's
        ``time.monotonic()`` (the system's monotonic clock, as the scheduler's)."""
        side = self.connector.scheduler_side
        cache = side.cache.stats()
        return {
            "now": time.monotonic(),
            "killed_at": self.killed_at,
            "encoded": self.encoded,
            "watched": side.workers(),
            "deaths": [asdict(d) for d in side.deaths()],
            "holds": side.holds(),
            "sizes": side.sizes(),
            "pinned_entries": cache.pinned_entries,
            "cache_requests": cache.open_requests,
            "states": {k: side.cache.entry_state(k).name for k in keys},
        }

    def fence(self, keys: list[str] = []) -> dict[str, Any]:  # noqa: B006 (never changed)
        """The connector's cache fences (as its automatic fencer would); how many ranges it
        freed, then ``ranks(keys)``."""
        freed = self.connector.scheduler_side.cache.fence()
        return {"freed": freed, **self.ranks(keys)}

    def shutdown(self, keys: list[str] = []) -> dict[str, Any]:  # noqa: B006 (never changed)
        """vLLM's own shutdown of the engine core (``EngineCore.shutdown``: the executor and
        its workers, then the scheduler, which shuts the connector down), as its failure path
        ends; then ``ranks(keys)``."""
        self.llm.llm_engine.engine_core.shutdown()
        return self.ranks(keys)


def _plain(value: object) -> bool:
    return isinstance(value, int | float | str | bool) or value is None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--ec", default=None, help="ec_transfer_config as JSON")
    parser.add_argument("--engine-args", default="{}", help="more arguments of LLM, as JSON")
    args = parser.parse_args()
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    ec = json.loads(args.ec) if args.ec else None
    try:
        engine = Engine(args.model, ec, json.loads(args.engine_args))
    except BaseException:
        traceback.print_exc()
        reply.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
        return 1
    reply.write(json.dumps({"ok": True, "ready": True, **engine.stats()}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            if op == "quit":
                if engine.connector is not None:
                    engine.connector.shutdown()
                reply.write(json.dumps({"ok": True}) + "\n")
                return 0
            result = getattr(engine, op)(**command)
            reply.write(json.dumps({"ok": True, **result}) + "\n")
        except Exception:
            traceback.print_exc()
            reply.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
