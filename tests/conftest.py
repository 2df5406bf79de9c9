"""Shared test setup: Hypothesis profiles, the lock-order checker and this session's ports.

Profiles (choose with HYPOTHESIS_PROFILE): ``dev`` is fast for local loops, ``ci`` runs at
least 1000 state-machine examples (CI sets it; Hypothesis would otherwise load its own small
built-in ``ci`` profile whenever ``CI`` is set), ``nightly`` is 100x ``ci``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for `models`

from embcache import EmbeddingCache  # after the path: this checkout first
from embcache.testing import FaultInjectingStore

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("dev", max_examples=60, stateful_step_count=30, **_common)
settings.register_profile("ci", max_examples=1000, stateful_step_count=60, **_common)
settings.register_profile("nightly", max_examples=100_000, stateful_step_count=60, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_configure(config: pytest.Config) -> None:
    """Lease this session's block of ports (``tests/support/ports.py``) and keep Mooncake's
    clients, here and in every process the tests start, inside it."""
    from tests.support import ports

    os.environ.update(ports.environment())


if os.environ.get("EMBCACHE_LOCK_CHECK", "1") not in ("", "0"):
    from embcache.driver.locks import enable_lock_checking

    enable_lock_checking()


@pytest.fixture
def store() -> Iterator[FaultInjectingStore]:
    """An FaultInjectingStore whose held transfers are released at the end."""
    s = FaultInjectingStore()
    yield s
    s.release_holds()


@pytest.fixture
def make_cache(store: FaultInjectingStore) -> Iterator[Callable[..., EmbeddingCache]]:
    """Makes EmbeddingCaches on ``store`` (by default), all closed at the end."""
    caches: list[EmbeddingCache] = []

    def make(capacity: int = 1 << 20, **kwargs: Any) -> EmbeddingCache:
        kwargs.setdefault("store", store)
        cache = EmbeddingCache(capacity, pin_memory=False, **kwargs)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        release = getattr(cache.store, "release_holds", None)
        if release is not None:
            release()
        cache.close()


@pytest.fixture(params=["plain", "poison"])
def poison_modes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: as is, and with every cache poisoning the ranges it frees
    (``EMBCACHE_POISON=1``), so a read after release shows as NaN or wrong bytes."""
    monkeypatch.setenv("EMBCACHE_POISON", "1" if request.param == "poison" else "0")
    return str(request.param)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used a ``MooncakeMaster`` shows the end of that master's log."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    from embcache.store.mooncake_master import MooncakeMaster

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, MooncakeMaster):
            report.sections.append((f"log of {name} (last 40 lines)", value.log_tail(40)))
