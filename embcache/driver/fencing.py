"""Fencing by the cache itself: a background thread that fences when the quarantine grows.

A transfer that ended UNKNOWN leaves its range QUARANTINED until a fence makes sure no old
transfer can land any more. A server that never calls ``fence()`` would lose pool capacity to
every timeout, so each cache runs one ``Fencer``: it looks at the quarantine every
``check_interval_s`` and fences when more than ``max_fraction`` of the pool is quarantined or
the oldest quarantined range is ``max_age_s`` old, at most once every ``min_interval_s``. It runs
one fence at a time, holds no lock while it fences (``EmbeddingCache.fence`` takes the cache lock
only around its two core calls) and stops when the cache closes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from embcache.errors import ClosedError, InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FencePolicy:
    """When the cache fences by itself (see the module docstring)."""

    max_fraction: float = 0.05
    max_age_s: float = 10.0
    min_interval_s: float = 1.0
    check_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_fraction <= 1.0:
            raise InvalidArgumentError(
                f"max_fraction must be within [0, 1], got {self.max_fraction}"
            )
        for name in ("max_age_s", "min_interval_s", "check_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value!r}")


class Fencer:
    """The background thread of one cache. ``due(now)`` asks the core (under the cache lock);
    ``fence()`` is the cache's own fence. Both are bound methods of the cache, held weakly: a
    cache dropped without ``close()`` ends its fencer."""

    def __init__(
        self, policy: FencePolicy, due: Callable[[float], bool], fence: Callable[[], int]
    ) -> None:
        self._policy = policy
        self._due = weakref.WeakMethod(due)
        self._fence = weakref.WeakMethod(fence)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embcache-fencer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and wait for a fence in progress to end."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        last = -math.inf
        while not self._stop.wait(self._policy.check_interval_s):
            now = time.monotonic()
            if now - last < self._policy.min_interval_s:
                continue
            try:
                fenced = self._fence_if_due(now)
            except ClosedError:
                return
            except Exception:  # a fence that failed (a dead master) is tried again later
                log.warning("automatic fence failed; it is retried", exc_info=True)
                last = now
                continue
            if fenced is None:
                return  # the cache is gone
            if fenced:
                last = now

    def _fence_if_due(self, now: float) -> bool | None:
        """Fence if due; None once the cache is gone. Holds the cache only while it runs."""
        due, fence = self._due(), self._fence()
        if due is None or fence is None:
            return None
        if not due(now):
            return False
        log.debug("automatic fence freed %d quarantined ranges", fence())
        return True
