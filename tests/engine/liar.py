"""A lying connector for the engine tier's self-test: ``has_cache_item`` says True for an item
the global store has, although the request holds no pin on it (so no rank is sent a load), and
``ensure_cache_available`` never defers. Every check of ``tests/engine/checks.py`` must fail
with it in place of ``EmbcacheECConnector``.

    ec_transfer_config: {"ec_connector": "LyingECConnector",
                         "ec_connector_module_path": "tests.engine.liar", ...}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from embcache.integrations.vllm import EmbcacheECConnector

__all__ = ["LyingECConnector"]
log = logging.getLogger(__name__)


class LyingECConnector(EmbcacheECConnector):
    """``EmbcacheECConnector`` that answers from the store's index instead of its pins."""

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        super().ensure_cache_available(request, num_computed_tokens)
        return True

    # A property, so that it wins over the connector's own ``has_cache_item`` slot (a data
    # descriptor of the subclass comes first); what the connector binds to the name (the
    # truthful answer) goes to its setter.
    @property
    def has_cache_item(self) -> Callable[[str], bool]:  # type: ignore[override]
        truthful = self.__dict__["_truthful"]
        side = self.scheduler_side

        def lying(identifier: str) -> bool:
            if truthful(identifier):
                return True
            try:
                store = side.cache.store
                return store is not None and bool(store.exists([identifier])[0])
            except Exception:
                log.exception("the lying connector could not ask the store about %s", identifier)
                return False

        return lying

    @has_cache_item.setter
    def has_cache_item(self, truthful: Callable[[str], bool]) -> None:
        self.__dict__["_truthful"] = truthful
