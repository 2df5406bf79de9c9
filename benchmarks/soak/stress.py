"""Soak: the stress workload for a long time against a flaky Mooncake store whose master dies.

What runs. The random multi-threaded workload of ``tests/support/stress_workload.py`` (8 request
threads, a monitor calling ``check_invariants()`` every 2 ms) on an ``EmbeddingCache`` whose
global store is a real ``mooncake_master`` on loopback, reached through ``FlakyStore``: a
wrapper that, at random, delays a call, raises from it, or turns single results into FAILED,
UNKNOWN or short reads. Every ``--kill-every-s`` seconds (jittered) the master is SIGKILLed
and started again ``--down-s`` seconds later (it comes back empty). Nobody calls ``fence()``:
the workload's mix has no fence and the cache's own fencer (``FencePolicy()``, the default) is
the only one, until the run ends.

What it reports. Operations and requests, automatic fences, the fault and kill counts,
invariant checks passed, the quarantined bytes when the workload stops, the capacity lost
after one final ``fence()`` (must be 0), pins and open requests left (0), and the process's
resident memory (``VmRSS``) at the start, after the warm-up and at the end (growth must stay
under 5%; sampled every 30 s for the trend). The end state is then checked as the stress tests
check it (``Workload.check_end_state``: no leak, every entry's bytes intact). Exit status 1 when
a check fails. Not a CI test (``tests/stress/test_soak_smoke.py`` runs it for seconds).

Run: MALLOC_ARENA_MAX=2 python -m benchmarks.soak.stress [--minutes 30] [--json out.json]  (needs
the mooncake extra). With glibc's default arenas resident memory steps up after master restarts
until it levels off (fragmentation, +33% in 10 minutes with a kill a minute: README,
"Reliability"), which hides the growth this soak looks for.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from embcache import EmbeddingCache
from embcache.driver.fencing import FencePolicy
from embcache.driver.global_store import TransferOutcome
from embcache.store.mooncake import MooncakeStore, quiet_native_logging
from embcache.store.mooncake_master import MooncakeMaster, find_master_binary
from tests.support.stress_workload import Mix, Workload

UNIT = 1024
POOL_UNITS = 40
RSS_GROWTH_LIMIT = 0.05
# Codes only FlakyStore returns (Mooncake's own are small negatives, see CODES).
FLAKY_FAILED = -910_001
FLAKY_UNKNOWN = -910_002


class FlakyFault(RuntimeError):
    """Raised by a ``FlakyStore`` call chosen to fail as a whole (its items end UNKNOWN)."""


class FlakyStore:
    """A ``GlobalStore`` that forwards to ``inner`` and misbehaves at random.

    Per call: with ``delay`` a sleep of up to 5 ms first, with ``raise_`` a ``FlakyFault``
    instead of the call. Per item, after the real transfer returned: with ``fail`` a code that
    means nothing is in flight (FAILED), with ``unknown`` one that means something may be
    (UNKNOWN), and for a read with ``short`` one byte fewer than asked (FAILED). Thread-safe.
    """

    def __init__(
        self,
        inner: MooncakeStore,
        seed: int,
        *,
        delay: float = 0.1,
        raise_: float = 0.01,
        fail: float = 0.015,
        unknown: float = 0.015,
        short: float = 0.01,
    ) -> None:
        self.inner = inner
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._p = {"delay": delay, "raise": raise_, "fail": fail, "unknown": unknown}
        self._short = short
        kinds = ("delay", "raise", "fail", "unknown", "short")
        self.injected: dict[str, int] = dict.fromkeys(kinds, 0)

    def _draw(self) -> float:
        with self._lock:
            return self._rng.random()

    def _count(self, what: str) -> None:
        with self._lock:
            self.injected[what] += 1

    def _before_call(self) -> None:
        if self._draw() < self._p["delay"]:
            self._count("delay")
            time.sleep(self._draw() * 0.005)
        if self._draw() < self._p["raise"]:
            self._count("raise")
            raise FlakyFault("injected by FlakyStore")

    def _spoil(self, codes: list[int], sizes: Sequence[int], read: bool) -> list[int]:
        out = []
        fail, unknown = self._p["fail"], self._p["unknown"]
        for code, size in zip(codes, sizes, strict=True):
            draw = self._draw()
            if draw < fail:
                self._count("fail")
                code = FLAKY_FAILED
            elif draw < fail + unknown:
                self._count("unknown")
                code = FLAKY_UNKNOWN
            elif read and code == size and draw < fail + unknown + self._short:
                self._count("short")
                code = size - 1
            out.append(code)
        return out

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self.inner.register_buffer(buffer)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._before_call()
        return self.inner.exists(keys)

    def get_into(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._before_call()
        return self._spoil(self.inner.get_into(keys, offsets, sizes), sizes, read=True)

    def put_from(
        self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._before_call()
        return self._spoil(self.inner.put_from(keys, offsets, sizes), sizes, read=False)

    def classify(self, code: int) -> TransferOutcome:
        if code == FLAKY_FAILED:
            return TransferOutcome.FAILED
        if code == FLAKY_UNKNOWN:
            return TransferOutcome.UNKNOWN
        return self.inner.classify(code)

    def fence(self) -> None:
        self.inner.fence()

    def close(self) -> None:
        self.inner.close()


def rss_bytes() -> int:
    """This process's resident set size (``VmRSS`` in ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def threads_and_fds() -> tuple[int, int]:
    """This process's thread count and open file descriptors."""
    status = Path("/proc/self/status").read_text().split("\n")
    threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return threads, len(os.listdir("/proc/self/fd"))


class Chaos:
    """The chaos thread of the workload: kills and restarts the master on a schedule, samples
    resident memory, and draws the progress bar."""

    def __init__(
        self,
        master: MooncakeMaster,
        store: MooncakeStore,
        workload: Workload,
        *,
        seconds: float,
        kill_every_s: float,
        down_s: float,
        warmup_s: float,
        progress: bool,
    ) -> None:
        self.master, self.store, self.workload = master, store, workload
        self.seconds, self.kill_every_s, self.down_s = seconds, kill_every_s, down_s
        self.warmup_s = warmup_s
        self.progress = progress
        self.kills = 0
        self.restarts = 0
        # (seconds into the run, resident bytes, threads, open file descriptors)
        self.samples: list[tuple[float, int, int, int]] = []
        self.rss_after_warmup: int | None = None

    def __call__(self, rng: random.Random, stop: threading.Event) -> None:
        started = time.monotonic()
        next_kill = started + self.kill_every_s * rng.uniform(0.8, 1.2)
        restart_at: float | None = None
        next_sample = started
        bar = tqdm(
            total=round(self.seconds),
            unit="s",
            desc="soak",
            disable=not self.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        try:
            while not stop.wait(0.25):
                now = time.monotonic()
                if restart_at is None and now >= next_kill:
                    with self.store._swap_lock:  # never under a client setup: see below
                        self.master.kill()
                    self.kills += 1
                    restart_at = now + self.down_s
                elif restart_at is not None and now >= restart_at:
                    self.master.start()
                    self.restarts += 1
                    restart_at = None
                    next_kill = time.monotonic() + self.kill_every_s * rng.uniform(0.8, 1.2)
                if now >= next_sample:
                    self.samples.append((now - started, rss_bytes(), *threads_and_fds()))
                    next_sample += 30.0
                if self.rss_after_warmup is None and now - started >= self.warmup_s:
                    self.rss_after_warmup = rss_bytes()
                operations, _, _, checks = self.workload.counts()
                bar.n = min(round(now - started), bar.total)
                bar.set_postfix(ops=operations, checks=checks, kills=self.kills, refresh=False)
                bar.refresh()
        finally:
            bar.close()
            if not self.master.running:
                self.master.start()
                self.restarts += 1


# The kill takes the store's ``_swap_lock``: Mooncake's client ``setup`` holds the GIL while it
# waits on the master, so a master that dies under a fence's or a reconnect's setup freezes
# the process (tests/stress/test_stress_mooncake.py, the xfail test). A deployment's master
# dies whenever it dies; this one is killed between setups so that the soak measures the
# cache, not that known Mooncake bug.


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def soak(
    seconds: float,
    *,
    kill_every_s: float,
    down_s: float,
    seed: int,
    warmup_s: float = 60.0,
    segment_mib: int = 16,
    policy: FencePolicy | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the soak (module docstring); return its numbers, ``checks`` mapping each end-state
    check to whether it held. ``policy`` is the cache's automatic fencing (default: the
    cache's default)."""
    quiet_native_logging()
    for name, value in MooncakeMaster.CLIENT_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    with tempfile.TemporaryDirectory(prefix="embcache-soak-") as log_dir:
        master = MooncakeMaster(find_master_binary(), Path(log_dir))
        master.start()
        try:
            with MooncakeStore(
                **master.store_kwargs(),
                global_segment_size=segment_mib << 20,
                key_prefix=f"soak-{uuid.uuid4().hex[:8]}/",
                reconnect_interval_s=0.1,
            ) as inner:
                return _run(
                    master,
                    inner,
                    policy or FencePolicy(),
                    seconds=seconds,
                    kill_every_s=kill_every_s,
                    down_s=down_s,
                    seed=seed,
                    warmup_s=warmup_s,
                    progress=progress,
                )
        finally:
            master.stop()


def _run(
    master: MooncakeMaster,
    inner: MooncakeStore,
    policy: FencePolicy,
    *,
    seconds: float,
    kill_every_s: float,
    down_s: float,
    seed: int,
    warmup_s: float,
    progress: bool,
) -> dict[str, Any]:
    inner.connect()
    store = FlakyStore(inner, seed)
    with EmbeddingCache(
        POOL_UNITS * UNIT, store=store, pin_memory=False, io_workers=4, auto_fence=policy
    ) as cache:
        workload = Workload(cache, seed=seed, unit=UNIT, mix=Mix(fence=0.0))
        chaos = Chaos(
            master,
            inner,
            workload,
            seconds=seconds,
            kill_every_s=kill_every_s,
            down_s=down_s,
            warmup_s=min(warmup_s, seconds / 4),
            progress=progress,
        )
        rss_start = rss_bytes()
        report = workload.run(seconds, chaos)
        workload.assert_no_errors()
        stopped = cache.stats()
        workload.drain()
        # The automatic fencer alone: wait for it to free what is quarantined (its age
        # trigger fires within max_age_s).
        drained_by_fencer = wait_for(
            lambda: "QUARANTINED" not in cache.stats().entries_by_state,
            policy.max_age_s + 30.0,
        )
        automatic_fences = cache.stats().fences
        cache.fence()  # the final fence
        final = cache.stats()
        lost = final.capacity_bytes - final.free_bytes - final.bytes_by_state.get("READY", 0)
        rss_end = rss_bytes()
        workload.check_end_state()  # no leak, entries' bytes intact; clears the cache
        rss_warm = chaos.rss_after_warmup or rss_start
        growth = (rss_end - rss_warm) / rss_warm
        result: dict[str, Any] = {
            "seconds": round(report.seconds, 1),
            "seed": seed,
            "operations": report.operations,
            "requests": report.requests,
            "views_checked": report.views_checked,
            "invariant_checks_passed": report.invariant_checks,
            "automatic_fences": automatic_fences,
            "master_kills": chaos.kills,
            "master_restarts": chaos.restarts,
            "faults_injected": dict(store.injected),
            "hits": stopped.hits,
            "loads_ok_failed_unknown": [
                stopped.loads_ok,
                stopped.loads_failed,
                stopped.loads_unknown,
            ],
            "publishes_ok_failed_unknown": [
                stopped.publishes_ok,
                stopped.publishes_failed,
                stopped.publishes_unknown,
            ],
            "evictions": stopped.evictions,
            "quarantined_bytes_at_stop": stopped.bytes_by_state.get("QUARANTINED", 0),
            "quarantine_drained_by_fencer": drained_by_fencer,
            "capacity_lost_after_final_fence": lost,
            "pins_left": final.pinned_entries,
            "requests_left": final.open_requests,
            "rss_start_mib": round(rss_start / 2**20, 1),
            "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
            "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth_after_warmup": round(growth, 4),
            "samples_s_rss_mib_threads_fds": [
                (round(t), round(b / 2**20, 1), n, fds) for t, b, n, fds in chaos.samples
            ],
            "load_average": list(os.getloadavg()),
            "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX", "glibc default"),
        }
        result["checks"] = {
            "capacity_lost_is_0": lost == 0,
            "no_pins_left": final.pinned_entries == 0,
            "no_requests_left": final.open_requests == 0,
            "rss_growth_under_5_percent": growth < RSS_GROWTH_LIMIT,
            "master_killed": chaos.kills > 0,
            "automatic_fences_ran": automatic_fences > 0,
            "quarantine_drained_by_fencer": drained_by_fencer,
            "end_state_checked": True,  # check_end_state raised otherwise
        }
        return result


def summary(result: dict[str, Any]) -> str:
    """The report as lines of text."""
    r = result
    lines = [
        f"soak: {r['seconds']} s, seed {r['seed']}, load average {r['load_average']}, "
        f"MALLOC_ARENA_MAX {r['malloc_arena_max']}",
        f"  {r['operations']} operations ({r['requests']} requests), "
        f"{r['views_checked']} views checked, "
        f"{r['invariant_checks_passed']} invariant checks passed",
        f"  {r['automatic_fences']} automatic fences, master killed {r['master_kills']} times "
        f"(restarted {r['master_restarts']}), faults injected {r['faults_injected']}",
        f"  hits {r['hits']}, loads ok/failed/unknown {r['loads_ok_failed_unknown']}, "
        f"publishes ok/failed/unknown {r['publishes_ok_failed_unknown']}, "
        f"evictions {r['evictions']}",
        f"  quarantined at stop {r['quarantined_bytes_at_stop']} B, drained by the fencer: "
        f"{r['quarantine_drained_by_fencer']}; capacity lost after the final fence "
        f"{r['capacity_lost_after_final_fence']} B; pins left {r['pins_left']}, "
        f"requests left {r['requests_left']}",
        f"  RSS start {r['rss_start_mib']} MiB, after warm-up {r['rss_after_warmup_mib']} MiB, "
        f"end {r['rss_end_mib']} MiB (growth {r['rss_growth_after_warmup']:+.2%})",
        "  every 30 s (s, RSS MiB, threads, fds): "
        + ", ".join(map(str, r["samples_s_rss_mib_threads_fds"])),
        "  checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()),
    ]
    return "\n".join(lines)


FENCE = ("max_age_s", "min_interval_s", "check_interval_s")  # --fence's three values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the workload runs")
    parser.add_argument(
        "--kill-every-s", type=float, default=180.0, help="seconds between master kills (+-20%%)"
    )
    parser.add_argument("--down-s", type=float, default=10.0, help="seconds the master stays dead")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="RSS baseline after this")
    parser.add_argument(
        "--segment-mib", type=int, default=16, help="memory this process lends to the store"
    )
    parser.add_argument(
        "--fence",
        type=float,
        nargs=3,
        default=None,
        metavar=("MAX_AGE_S", "MIN_INTERVAL_S", "CHECK_INTERVAL_S"),
        help="the cache's automatic fencing (FencePolicy; default: the cache's own)",
    )
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="the tqdm bar on stderr (auto: when stderr is a terminal)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"soak seed {seed}", flush=True)
    result = soak(
        args.minutes * 60,
        kill_every_s=args.kill_every_s,
        down_s=args.down_s,
        seed=seed,
        warmup_s=args.warmup_s,
        segment_mib=args.segment_mib,
        policy=None
        if args.fence is None
        else FencePolicy(**dict(zip(FENCE, args.fence, strict=True))),
        progress=args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty()),
    )
    print(summary(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
