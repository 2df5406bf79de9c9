"""Copies of large byte ranges over more than one core: the range is cut into chunks that the
calling thread and a few helper threads claim one at a time.

Design notes. One ``memmove`` on the calling thread copies at one core's speed; torch's
``copy_`` splits a large copy over its intra-op threads, faster on an idle machine (the issue
56 measure: our one ``memmove`` at 0.83-0.89x torch's copy of 4 MB). Measured on the 2-core
development machine under a load of 12-15 (GB/s, medians of 30 alternating chunks, source
and destination cycled through 256 MB; three runs): split/``memmove`` 0.59x at 2 MB,
0.68-0.99x at 4 MB, 0.91-1.13x at 64 MB, so under such a load the split gains nothing over
one core and its gain is the idle machine's, where torch's split beat the one ``memmove``;
torch's two-thread ``copy_`` was 0.1-0.2 GB/s up to 4 MB there (a helper descheduled),
1.25-1.4 at 64 MB. Hence ``SPLIT_BYTES``. The server's mixes (``benchmarks.server.
bench_server``, steady and scan, 200 requests, 1024 hidden, two runs each with and without the
split, then at 2 MiB, alternating) lost nothing to the helpers: the cache's share of request
time fell 1.6-4.4 points on each of embcache's six rows (SGLang's, whose copies did not
change, moved 0.4 at most); requests/s moved with the load, both ways.

A split that hands fixed halves to helpers waits for whichever helper is descheduled
(``PoolViews``' notes: a median of 16 ms against 0.1 ms on a loaded machine), so here nothing
is handed out: the caller posts the copy to the helpers and starts claiming chunks itself,
each claim one step of a shared counter (atomic under the interpreter lock, no lock taken); a
helper that wakes late finds fewer chunks or none, so the caller waits at most for the chunks
helpers are copying, never for a helper to start. Every copy releases the interpreter lock
(``ctypes.memmove``) and no lock is held across one: the one lock a copy takes guards its
count of finished chunks (its end is signalled through a second, taken when the copy is posted
and let go by the thread that finishes the last chunk: a signal that excludes no one). A chunk
that raises ends the copy: the caller raises its error once every chunk is done (the range is
then partly copied, as a single ``memmove`` that faulted would leave it). Helpers are daemon
threads (no ``threading.Thread``: starting one waits until it runs) started on the first split
copy; ``HELPERS`` of them (the cores less the caller, at most 3).
"""

from __future__ import annotations

import _thread
import ctypes
import itertools
import os
import queue
import threading

__all__ = ["CHUNK_BYTES", "HELPERS", "SPLIT_BYTES", "split_copy"]

SPLIT_BYTES = 4 << 20  # measured (module notes): below it a split copy lost to one memmove
CHUNK_BYTES = 512 << 10  # a claim's share: small enough that a late helper still helps
HELPERS = max(0, min(os.cpu_count() or 1, 4) - 1)

memmove = ctypes.memmove  # each chunk's copy; a CFUNCTYPE call: releases the interpreter lock


class _Copy:
    """One split copy: its range, the chunk counter, and the count of chunks done."""

    __slots__ = ("chunks", "claim", "done", "dst", "ended", "error", "lock", "nbytes", "src")

    def __init__(self, dst: int, src: int, nbytes: int) -> None:
        self.dst, self.src, self.nbytes = dst, src, nbytes
        self.chunks = -(-nbytes // CHUNK_BYTES)
        self.claim = itertools.count().__next__  # atomic: one C call under the interpreter lock
        self.lock = threading.Lock()
        self.done = 0
        self.error: BaseException | None = None
        # A signal, not a lock: taken now, let go by whichever thread finishes the last chunk;
        # the caller waits on it (a bare lock, so a profile counts the wait as the copy's).
        self.ended = threading.Lock()
        self.ended.acquire()

    def work(self) -> None:
        """Copy chunks until none is left to claim."""
        while (index := self.claim()) < self.chunks:
            start = index * CHUNK_BYTES
            try:
                memmove(self.dst + start, self.src + start, min(CHUNK_BYTES, self.nbytes - start))
            except BaseException as exc:  # handed to the caller, which raises it
                self.error = exc
            with self.lock:
                self.done += 1
                last = self.done == self.chunks
            if last:
                self.ended.release()


class _Helpers:
    """The helper threads and the queue they take copies from (started on first use)."""

    def __init__(self) -> None:
        self._posted: queue.SimpleQueue[_Copy] = queue.SimpleQueue()
        self._started = False
        self._start_lock = threading.Lock()

    def post(self, copy: _Copy, helpers: int) -> None:
        if not self._started:
            with self._start_lock:
                if not self._started:
                    for _ in range(HELPERS):  # (``threading.Thread.start`` would wait for it)
                        _thread.start_new_thread(self._serve, ())
                    self._started = True
        for _ in range(helpers):
            self._posted.put(copy)

    def _serve(self) -> None:
        while True:
            self._posted.get().work()


_helpers = _Helpers()


def split_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to address ``dst`` (host memory, not overlapping)
    on the calling thread and up to ``HELPERS`` helpers; returns when every byte is copied,
    or raises the first error a chunk raised. The caller must hold no lock (none is taken
    across a chunk's copy)."""
    copy = _Copy(dst, src, nbytes)
    helpers = min(HELPERS, copy.chunks - 1)
    if helpers > 0:
        _helpers.post(copy, helpers)
    copy.work()
    copy.ended.acquire()
    if copy.error is not None:
        raise copy.error
