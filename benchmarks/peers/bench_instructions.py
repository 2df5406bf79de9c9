"""Instructions per operation, counted by callgrind: embcache against SGLang 0.5.23's controller.

A time on a shared machine moves with its load; an instruction count does not. Both sides do the
same work in one process run under ``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0`` and no
background thread ticking (embcache's automatic fence off, ``auto_fence=None``; SGLang's IO
thread stopped); only the main thread's instructions are read (``--separate-threads=yes``).
Collection is off during start-up and set-up; around each measured region the process toggles
it on and off and dumps the counts (torch's ``_valgrind_toggle``, callgrind's client requests).
Each side runs a warm-up, then ``low`` operations, then ``high``; the cost of one operation is
(count of ``high`` - count of ``low``) / (``high`` - ``low``), so what the region costs once
(the toggles, the loop) cancels out.

- 8-item all-hit request over a pool of ``entries`` 256 B entries (bf16, CPU): ours is
  ``cache.request()``, ``lookup(items, prefetch=False)``, ``embeddings()``, close, through the
  public API; SGLang's is ``get_pool_views(keys)`` + ``release_pool_views(keys)`` with 256 B
  pages (one entry a page). Each request takes 8 distinct keys, the same on both sides. Ours
  also in two steps: ``cache.lookup(id, items, prefetch=False)`` (open and look up in one
  step), ``embeddings()`` (no step: the lookup's answer), close.
- evicting insert: the pool holds exactly ``entries`` 256 B entries, the oldest half pinned by
  an open request, so each insert of a fresh key evicts one idle entry (as
  ``benchmarks.micro.bench_eviction``). Ours two ways: a request inserting one item, closed; and
  ``cache.insert`` with no request, as a caller like SGLang's ``store_to_pool_async`` does it.
  SGLang's: the steps of ``store_to_pool_async`` + ``wait_store_to_pool`` for a CPU tensor
  (``benchmarks.peers.bench_peers.sglang_evicting_side``, its own code from the wheel).

With ``--bytecodes`` it counts, without valgrind, what the interpreter runs per operation of
the same sides: bytecodes (``sys.settrace`` opcode events), Python functions entered and C
functions called (``sys.setprofile``), exact and repeatable; the rows say how much more Python
work ours does than SGLang's, whatever each bytecode costs.

Rows are ``{name, ours, baseline, unit, ratio, target, met}`` in thousands of instructions per
operation; the ratio is SGLang's count / ours (below 1: ours executes more), target >= 1.0x.
Needs valgrind (``apt-get install valgrind``); the sglang wheel as ``tests.support.sglang_wheel``.
Run from the repository root: python -m benchmarks.peers.bench_instructions [--json OUT] [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Row, insert_all, make_row, print_rows, skipped_row
from benchmarks.peers import bench_peers
from embcache import EmbeddingCache, Item
from embcache.core.policy import Policy
from tests.support.callgrind import Unavailable, per_operation, total
from tests.support.sglang_wheel import SGLangPeer

ENTRY_BYTES = 256
SHAPE = (ENTRY_BYTES // 2,)  # bf16
BATCH = 8
WARMUP = 20  # operations before counting: Python's adaptive interpreter settles in a few
ROOT = Path(__file__).resolve().parents[2]

Op = Callable[[int], None]


# ---------------------------------------------------------------------------- the two sides
def ours_cache(entries: int, policy: str | Policy = "lru") -> EmbeddingCache:
    """A CPU cache of exactly ``entries`` 256 B entries, no automatic fence thread, with
    ``policy`` (``lru`` against SGLang's controller, whose order is LRU: like for like, and
    every operation runs the same code, so a count per operation is exact)."""
    return EmbeddingCache(
        entries * ENTRY_BYTES,
        alignment=ENTRY_BYTES,
        pin_memory=False,
        io_workers=1,
        auto_fence=None,
        policy=policy,
    )


def ours_hit(
    entries: int,
    batches: list[list[str]],
    two_steps: bool = False,
    policy: str | Policy = "lru",
) -> tuple[Op, Callable[[int], None]]:
    """Ours' 8-item all-hit request, and a check of what the first ``n`` ops did (uncounted):
    ``cache.request()``, ``lookup``, ``embeddings()``, close; or, ``two_steps``,
    ``cache.lookup(id, items)`` (open and look up in one step), ``embeddings()``, close.
    ``policy``: the cache's (``ours_cache``)."""
    cache = ours_cache(entries, policy)
    tensor = torch.zeros(SHAPE, dtype=torch.bfloat16)
    with cache.request("fill") as fill:
        insert_all(fill, [f"img{i}" for i in range(entries)], tensor)
    requests = [[Item(key, SHAPE, torch.bfloat16) for key in batch] for batch in batches]
    hits = cache.stats().hits

    def op(n: int) -> None:
        with cache.request(f"h{n}") as request:
            request.lookup(requests[n], prefetch=False)
            request.embeddings()

    def op_in_two_steps(n: int) -> None:
        request, _ = cache.lookup(f"h{n}", requests[n], prefetch=False)
        with request:
            request.embeddings()

    def check(done: int) -> None:
        stats = cache.stats()
        assert stats.hits - hits == BATCH * done and not stats.misses_by_reason, stats
        assert stats.pinned_entries == 0 and stats.open_requests == 0, stats
        cache.check_invariants()

    return (op_in_two_steps if two_steps else op), check


def sglang_hit(entries: int, batches: list[list[str]]) -> tuple[Op, Callable[[int], None]]:
    """SGLang's ``get_pool_views`` + ``release_pool_views`` of 8 cached keys, and a check."""
    peer = SGLangPeer(entries * ENTRY_BYTES, ENTRY_BYTES // 2, torch.bfloat16, ENTRY_BYTES)
    tensor = torch.zeros(SHAPE, dtype=torch.bfloat16)
    for i in range(entries):
        assert peer.insert(f"img{i}", tensor)
    controller = peer.controller

    def op(n: int) -> None:
        keys = batches[n]
        controller.get_pool_views(keys)
        controller.release_pool_views(keys)

    def check(done: int) -> None:
        views = controller.get_pool_views(batches[0])
        assert all(view is not None for view in views)  # every key of a batch was a hit
        controller.release_pool_views(batches[0])
        assert not any(entry.ref_count for entry in controller.entries.values())

    return op, check


def ours_evicting(entries: int, request_less: bool) -> tuple[Op, Callable[[int], None]]:
    """Ours' evicting insert into a full pool, the oldest half pinned, and a check: one item
    inserted by a request that then closes, or (``request_less``) by ``cache.insert``, the call
    for a caller with no request such as SGLang's ``store_to_pool_async``."""
    cache = ours_cache(entries)
    tensor = torch.zeros(SHAPE, dtype=torch.bfloat16)
    half = entries // 2
    oldest = cache.request("oldest-half")  # stays open: its entries stay pinned
    insert_all(oldest, [f"old{i}" for i in range(half)], tensor)
    with cache.request("newer-half") as newer:
        insert_all(newer, [f"new{i}" for i in range(half, entries)], tensor)
    before = cache.stats()
    assert before.free_bytes == 0 and before.pinned_entries == half

    def in_request(n: int) -> None:
        with cache.request(f"e{n}") as request:
            request.insert([f"fresh{n}"], [tensor], publish=False)

    def no_request(n: int) -> None:
        cache.insert([f"fresh{n}"], [tensor], publish=False)

    def check(done: int) -> None:
        stats = cache.stats()
        assert stats.inserts - before.inserts == done, stats
        assert stats.evictions - before.evictions == done, stats
        assert stats.free_bytes == 0 and stats.pinned_entries == half, stats
        cache.check_invariants()

    return no_request if request_less else in_request, check


def sglang_evicting(entries: int) -> tuple[Op, Callable[[int], None]]:
    """SGLang's evicting insert (``bench_peers.sglang_evicting_side``, same pool), no check
    beyond its own: the side asserts each insert took place."""
    tensor = torch.zeros(SHAPE, dtype=torch.bfloat16)
    return bench_peers.sglang_evicting_side(entries, tensor), lambda done: None


# ---------------------------------------------------------------------------- bytecodes
def sides_of(entries: int, ops: int) -> tuple[dict[str, tuple[Op, Callable[[int], None]]], str]:
    """Every side, set up for ``ops`` operations; and why SGLang's are missing ("" if not)."""
    rng = random.Random(entries)
    batches = [rng.sample([f"img{i}" for i in range(entries)], BATCH) for _ in range(ops)]
    why = bench_peers.sglang_missing()
    sides: dict[str, tuple[Op, Callable[[int], None]]] = {
        "ours hit": ours_hit(entries, batches),
        "ours hit in two steps": ours_hit(entries, batches, two_steps=True),
        "ours evicting insert": ours_evicting(entries, request_less=False),
        "ours request-less insert": ours_evicting(entries, request_less=True),
    }
    if why is None:
        sides["sglang hit"] = sglang_hit(entries, batches)
        sides["sglang evicting insert"] = sglang_evicting(entries)
    return sides, why or ""


def python_work(op: Op, first: int, ops: int) -> dict[str, float]:
    """Bytecodes, Python functions entered and C functions called per call of ``op(n)``, for
    ``n`` in ``first .. first + ops - 1``."""
    counts = {"bytecodes": 0, "python calls": 0, "C calls": 0}

    def trace(frame: Any, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts["bytecodes"] += 1
        return trace

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call":
            counts["python calls"] += 1
        elif event == "c_call":
            counts["C calls"] += 1

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        for n in range(first, first + ops):
            op(n)
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    counts["C calls"] -= 2  # the calls that turn the counting off: sys.settrace, sys.setprofile
    return {name: count / ops for name, count in counts.items()}


def bytecode_rows(entries: int = 1_000, ops: int = 50) -> list[Row]:
    """Per operation, ours against SGLang's: bytecodes, Python calls and C calls, for the hit
    and the evicting insert in a request and by ``cache.insert``."""
    sides, why = sides_of(entries, WARMUP + ops)
    work = {}
    for name, (op, check) in sides.items():
        for n in range(WARMUP):
            op(n)
        work[name] = python_work(op, WARMUP, ops)
        check(WARMUP + ops)
    pool = f"{entries} entries"
    compared = {
        f"{BATCH}-item all-hit request, {pool}": ("ours hit", "sglang hit"),
        f"{BATCH}-item all-hit in two steps (cache.lookup), {pool}": (
            "ours hit in two steps",
            "sglang hit",
        ),
        f"evicting insert in a request, {pool}, half pinned": (
            "ours evicting insert",
            "sglang evicting insert",
        ),
        f"evicting cache.insert, {pool}, half pinned": (
            "ours request-less insert",
            "sglang evicting insert",
        ),
    }
    out = []
    for what, (our_side, peer_side) in compared.items():
        for unit in ("bytecodes", "python calls", "C calls"):
            name = f"{unit}, {what}, vs SGLang"
            if peer_side not in work:
                out.append(skipped_row(name, why, ""))
                continue
            ours, peer = work[our_side][unit], work[peer_side][unit]
            out.append(make_row(name, ours, peer, "per op", peer / ours, "", None))
    return out


# ---------------------------------------------------------------------------- the counted process
def toggle() -> None:
    torch._C._valgrind_toggle()


def toggle_and_dump() -> None:
    torch._C._valgrind_toggle_and_dump_stats()


def child(entries: int, low: int, high: int) -> None:
    """Under callgrind: set every side up, then count each: warm-up, ``low`` ops (dump),
    ``high`` ops (dump). Prints the sides in dump order, or why SGLang's are skipped."""
    sides, why = sides_of(entries, WARMUP + low + high)
    order = []
    for name, (op, check) in sides.items():
        for n in range(WARMUP):
            op(n)
        start = WARMUP
        for count in (low, high):
            gc.collect()
            toggle()
            for n in range(start, start + count):
                op(n)
            toggle_and_dump()
            start += count
            order.append(name)
        check(start)
    print(json.dumps({"order": order, "sglang_missing": why or None}))


def count(entries: int, low: int, high: int) -> tuple[dict[str, float], str | None]:
    """Instructions per operation of each side, and why SGLang's are missing (or None)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise Unavailable("valgrind not on PATH (apt-get install valgrind)")
    if not torch._C._valgrind_supported_platform():
        raise Unavailable("this torch build has no callgrind client requests")
    bench_peers.sglang_missing()  # fetch the wheel now, not under callgrind
    with tempfile.TemporaryDirectory(prefix="embcache-callgrind-") as folder:
        out = Path(folder)
        command = [
            valgrind,
            "--tool=callgrind",
            "--collect-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={out}/cg.%p",
            sys.executable,
            "-m",
            "benchmarks.peers.bench_instructions",
            "--child",
            f"--entries={entries}",
            f"--low={low}",
            f"--high={high}",
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            said = [line for line in done.stderr.splitlines() if not line.startswith("==")]
            raise Unavailable(f"the counted run failed ({done.returncode}): {said[-3:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        main_thread = sorted(
            out.glob("cg.*.*-01"), key=lambda p: int(p.name.split(".")[-1].split("-")[0])
        )
        order: list[str] = report["order"]
        if len(main_thread) != len(order):
            raise Unavailable(f"{len(order)} regions but {len(main_thread)} dumps in {out}")
        counts = [total(path) for path in main_thread]
    return per_operation(order, counts, high - low), report["sglang_missing"]


def rows(entries: int = 1_000, low: int = 10, high: int = 110) -> list[Row]:
    """Thousands of instructions per op, ours against SGLang's: the hit, the evicting insert
    in a request and by ``cache.insert`` (both against SGLang's one evicting insert)."""
    pool = f"{entries} entries"
    compared = {  # row name: (our side, SGLang's side)
        f"instructions, {BATCH}-item all-hit request, {pool}, vs SGLang": (
            "ours hit",
            "sglang hit",
        ),
        f"instructions, {BATCH}-item all-hit in two steps (cache.lookup), {pool}, vs SGLang": (
            "ours hit in two steps",
            "sglang hit",
        ),
        f"instructions, evicting insert in a request, {pool}, half pinned, vs SGLang": (
            "ours evicting insert",
            "sglang evicting insert",
        ),
        f"instructions, evicting cache.insert, {pool}, half pinned, vs SGLang": (
            "ours request-less insert",
            "sglang evicting insert",
        ),
    }
    try:
        per_op, why = count(entries, low, high)
    except Unavailable as exc:
        return [skipped_row(name, str(exc), ">= 1.0x") for name in compared]
    out = []
    for name, (our_side, peer_side) in compared.items():
        ours = per_op[our_side]
        peer = per_op.get(peer_side)
        if peer is None:
            out.append(skipped_row(name, why or "", ">= 1.0x"))
            continue
        out.append(
            make_row(name, ours / 1e3, peer / 1e3, "k instr", peer / ours, ">= 1.0x", peer >= ours)
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000, help="entries in the pool")
    parser.add_argument("--low", type=int, default=10, help="operations of the first count")
    parser.add_argument("--high", type=int, default=110, help="operations of the second count")
    parser.add_argument("--tiny", action="store_true", help="64 entries, 1 and 3 operations")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the rows as a JSON list")
    parser.add_argument(
        "--bytecodes",
        action="store_true",
        help="count bytecodes, Python calls and C calls per operation instead (no valgrind)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.entries, args.low, args.high = 64, 1, 3
    if args.child:
        child(args.entries, args.low, args.high)
        sys.exit(0)
    if args.bytecodes:
        result = bytecode_rows(args.entries, 5 if args.tiny else 50)
    else:
        result = rows(args.entries, args.low, args.high)
    print_rows(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
