"""Where the cache's share of a request's time goes: each contender's cache calls profiled.

Every contender serves a mix as in ``bench_server``'s mixes part, the contenders taking turns
segment by segment, with a ``cProfile`` profiler per client thread switched on only while the
thread is in the cache (``Contender._timed``; the pipeline: all of ``encode`` but its encoder
calls). The profiled time is then split by what ran (``category``):

- ``lock waits``: acquiring (and releasing) a lock outside a condition wait;
- ``core step``: the cache's own state machine: ``embcache/core`` for embcache (compiled, its
  steps are builtins to cProfile: methods of ``CacheCore`` and of ``StateQueries``), the
  controller's module for SGLang 0.5.23 and the original PR (their bookkeeping is their core);
- ``driver Python``: every other Python line in the cache call (embcache's driver, adapters,
  pipeline; the serving sequence's own code) and the builtins it calls;
- ``torch tensors and views``: torch calls that make tensors or views (not copies);
- ``copies``: ``copy_``, ``memmove``, ``clone`` and ``torch.cat``: moving payload bytes, and
  the own time of ``COPY_FUNCTIONS`` (a ``ctypes`` foreign call is no builtin to cProfile: the
  ``memmove`` inside embcache's ``copy_bytes`` shows only as that function's own time);
- ``single-flight waits``: a condition or event wait: waiting for another request's encode or
  load. It replaces an encode, so it is reported apart from the overhead;
- ``I/O hand-offs``: submitting work to I/O threads (``concurrent.futures``, queues);
- ``polling sleeps``: ``time.sleep`` in a polling loop (MMEncoder's prefetch poll).

A builtin that is none of these (a dict lookup, ``len``) counts in its caller's category.
cProfile slows Python calls more than C calls, so the split is of profiled time; ``ms`` scales
each share to the cache time per request measured without the profiler in the mixes part of
the same run, when that part ran.
"""

from __future__ import annotations

import cProfile
import pstats
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CATEGORIES = (
    "lock waits",
    "core step",
    "driver Python",
    "torch tensors and views",
    "copies",
    "single-flight waits",
    "I/O hand-offs",
    "polling sleeps",
)
WAITS = "single-flight waits"
CORE_FILES = ("/embcache/core/", "embedding_cache_controller", "tests/support/baselines.py")
CORE_BUILTINS = ("of 'CacheCore' objects", "of 'StateQueries' objects")  # the compiled core's steps
COPY_FUNCTIONS = (  # a ctypes memmove, or a split one (its chunks, its wait for them)
    ("/embcache/driver/pool.py", "copy_bytes"),
    ("/embcache/driver/parallel_copy.py", "split_copy"),
    ("/embcache/driver/parallel_copy.py", "work"),
)

Key = tuple[str, int, str]


class Profiles:
    """One ``cProfile.Profile`` per thread, on only inside ``on()`` (nesting allowed) and
    paused inside ``off()``. Thread-safe: each thread touches only its own profiler."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._made: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    @contextmanager
    def on(self) -> Iterator[None]:
        """Profile this thread for the block."""
        local = self._local
        if getattr(local, "profile", None) is None:
            local.profile, local.depth = cProfile.Profile(), 0
            with self._lock:
                self._made.append(local.profile)
        local.depth += 1
        if local.depth == 1:
            local.profile.enable()
        try:
            yield
        finally:
            local.depth -= 1
            if local.depth == 0:
                local.profile.disable()

    @contextmanager
    def off(self) -> Iterator[None]:
        """Pause this thread's profiler for the block (an encoder call), if it is on."""
        local = self._local
        active = getattr(local, "depth", 0) > 0
        if active:
            local.profile.disable()
        try:
            yield
        finally:
            if active:
                local.profile.enable()

    def seconds(self) -> dict[str, float]:
        """Profiled seconds per category, over every thread so far."""
        with self._lock:
            made = list(self._made)
        if not made:
            return dict.fromkeys(CATEGORIES, 0.0)
        return split(pstats.Stats(*made).stats)  # type: ignore[attr-defined]


def category(key: Key) -> str | None:
    """The category of one profiled function's own time; None: its callers' category."""
    path, _, name = key
    if path == "~":  # a builtin
        if any(word in name for word in ("copy_", "memmove", "clone", "torch.cat")):
            return "copies"
        if "time.sleep" in name:
            return "polling sleeps"
        if any(part in name for part in CORE_BUILTINS):
            return "core step"
        if "_thread.lock" in name or "_thread.RLock" in name:
            return None  # a condition wait or the lock: its caller says which
        if "torch" in name:
            return "torch tensors and views"
        return None
    path = path.replace("\\", "/")
    if any(path.endswith(file) and name == function for file, function in COPY_FUNCTIONS):
        return "copies"
    if any(part in path for part in CORE_FILES):
        return "core step"
    if "/concurrent/futures/" in path or path.endswith("/queue.py"):
        return "I/O hand-offs"
    if path.endswith("/threading.py") and name in ("wait", "wait_for"):
        return WAITS
    if "/torch/" in path:
        return "torch tensors and views"
    return "driver Python"


def split(stats: dict[Key, Any]) -> dict[str, float]:
    """Each function's own time (cProfile's tottime) added to its category; a builtin with no
    category of its own split over its call sites by the time each call site spent in it."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for key, (_, _, own, _, callers) in stats.items():
        mine = category(key)
        if mine is not None:
            out[mine] += own
            continue
        lock = "_thread.lock" in key[2] or "_thread.RLock" in key[2]
        for caller, edge in callers.items():
            by = category(caller) or "driver Python"
            if lock:  # a split copy's wait for its own chunks is copying
                by = by if by in (WAITS, "copies") else "lock waits"
            out[by] += edge[2]
    return out


def shares(seconds: dict[str, float]) -> dict[str, float]:
    """Each category's share of the profiled time (0 to 1)."""
    total = sum(seconds.values())
    return {name: (s / total if total else 0.0) for name, s in seconds.items()}


def table(breakdown: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Per mix and contender: each category's share of cache time, and ms per request where the
    unprofiled cache time is known."""
    lines = []
    head = "".join(f"{name[:12]:>13}" for name in CATEGORIES)
    for mix, rows in breakdown.items():
        lines.append(f"where the cache time goes, {mix} (share of profiled cache time; ms/req)")
        lines.append(f"  {'contender':<28}{head}")
        for contender, r in rows.items():
            cells = []
            for name in CATEGORIES:
                ms = r["ms"].get(name)
                cell = f"{100 * r['shares'][name]:4.0f}%"
                cell += f" {ms:5.2f}" if ms is not None else "      "
                cells.append(f"{cell:>13}")
            lines.append(f"  {contender:<28}{''.join(cells)}")
    return "\n".join(lines)


def cache_shares(
    cache_seconds: list[float], single_flight_seconds: float, latencies: list[float]
) -> tuple[float | None, float | None]:
    """The cache's share of request time and, beside it, the share of single-flight waits
    (waits for another request's encode of the same image: they replace an encode, so they
    are left out of the cache's share); None, None with no requests."""
    total = sum(latencies)
    if not latencies or total <= 0:
        return None, None
    return (sum(cache_seconds) - single_flight_seconds) / total, single_flight_seconds / total
