"""Fixtures of the vLLM tests: vLLM's interface from its wheel, and connectors made by vLLM's
own factory (closed at the end).

The wheel (336 MB) is downloaded when it is missing only in CI (``CI`` set) or with
``EMBCACHE_VLLM_DOWNLOAD=1``; elsewhere the tests skip, saying how to get it. In CI a wheel
that cannot be had fails the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support import vllm_wheel
from tests.vllm_connector.vllm_replay import vllm_config


@pytest.fixture(scope="session")
def vllm_base() -> Any:
    """vLLM's real ``ec_connector/base.py`` module (and the rest of its interface installed)."""
    return vllm_wheel.install_or_skip()


@pytest.fixture
def make_scheduler(vllm_base: Any) -> Iterator[Callable[..., Any]]:
    """Makes scheduler-role connectors through vLLM's ``ECConnectorFactory``; shut down at the
    end."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    made: list[Any] = []

    def make(extra: dict[str, Any] | None = None, *, role: str = "ec_both", world: int = 2) -> Any:
        config = vllm_config(role, extra or {}, world)
        connector = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.shutdown()
