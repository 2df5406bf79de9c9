"""Shared test setup: Hypothesis profiles, the lock-order checker, this session's ports, and the
real ``mooncake_master`` of the tests marked ``mooncake``, whatever their folder.

``mooncake_master`` (session scope) is shared: tests keep apart by giving each store a unique
key prefix (``key_prefix``). ``private_mooncake_master`` (function scope) is for tests that kill
or restart the master. Both serve Mooncake's HTTP metadata from the master process itself, on
loopback ports of this session's block (``tests/support/ports.py``: another run of the suite on
the machine has its own), and are stopped when the test ends, passed or failed. Without
``mooncake_master`` on PATH the tests skip, or fail when ``CI`` is set.

Profiles (choose with HYPOTHESIS_PROFILE): ``dev`` is fast for local loops, ``ci`` runs at
least 1000 state-machine examples (CI sets it; Hypothesis would otherwise load its own small
built-in ``ci`` profile whenever ``CI`` is set), ``nightly`` is 100x ``ci``.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for `models`

from embcache import EmbeddingCache  # after the path: this checkout first
from embcache.errors import StoreUnavailableError
from embcache.store.mooncake_master import MooncakeMaster, find_master_binary
from embcache.testing import FaultInjectingStore

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("dev", max_examples=60, stateful_step_count=30, **_common)
settings.register_profile("ci", max_examples=1000, stateful_step_count=60, **_common)
settings.register_profile("nightly", max_examples=100_000, stateful_step_count=60, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_report_header() -> str:
    """The hash seed, in the header: the frequency sketch's collisions (hence a few admission
    answers at the margin) depend on it, so a failure is rerun alike with the same seed."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return "PYTHONHASHSEED unset: a random hash seed nobody can name (.ci/test sets one)"
    return f"PYTHONHASHSEED={seed}: rerun a failure alike with this seed in the environment"


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


def _master_binary() -> str:
    """The binary; without it the test skips locally and fails in CI."""
    try:
        return find_master_binary()
    except StoreUnavailableError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def _running_master(log_dir: Path) -> Iterator[MooncakeMaster]:
    from tests.support import ports

    master = MooncakeMaster(_master_binary(), log_dir, ports.server_ports(3))
    try:
        master.start()
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A master shared by the session; never kill it (use ``private_mooncake_master``)."""
    yield from _running_master(tmp_path_factory.mktemp("mooncake"))


@pytest.fixture
def private_mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test alone, which it may kill and restart."""
    yield from _running_master(tmp_path)


@pytest.fixture
def key_prefix() -> str:
    """A key namespace of this test alone, so tests sharing a master never see each other."""
    return f"test-{uuid.uuid4().hex[:12]}/"


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
    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, MooncakeMaster):
            report.sections.append((f"log of {name} (last 40 lines)", value.log_tail(40)))
