"""A real ``mooncake_master`` on loopback, for tests marked ``mooncake``.

``mooncake_master`` (session scope) is shared: tests keep apart by giving each store a unique
key prefix. ``private_mooncake_master`` (function scope) is for tests that kill or restart the
master. Both serve Mooncake's HTTP metadata from the master process itself, on loopback ports of
this session's block (``tests/support/ports.py``: another run of the suite on the machine has
its own), and are stopped when the test ends, passed or failed. Without ``mooncake_master`` on
PATH the tests skip, or fail when ``CI`` is set.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.errors import StoreUnavailableError
from embcache.store.mooncake_master import MooncakeMaster, find_master_binary
from tests.support import ports

__all__ = ["MooncakeMaster"]


def _master_binary() -> str:
    """The binary; without it the test skips locally and fails in CI."""
    try:
        return find_master_binary()
    except StoreUnavailableError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def _running_master(log_dir: Path) -> Iterator[MooncakeMaster]:
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
