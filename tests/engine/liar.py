"""A lying connector for the engine tier's self-test: ``has_cache_item`` says True for an item
the global store has, although the request holds no pin on it (so no rank is sent a load), and
``ensure_cache_available`` never defers. Every check of ``tests/engine/checks.py`` must fail
with it in place of ``EmbcacheECConnector``.

    ec_transfer_config: {"ec_connector": "LyingECConnector",
                         "ec_connector_module_path": "tests.engine.liar", ...}
"""

from __future__ import annotations

import contextlib
from typing import Any

from embcache.integrations.vllm import EmbcacheECConnector

__all__ = ["LyingECConnector"]


class LyingECConnector(EmbcacheECConnector):
    """``EmbcacheECConnector`` that answers from the store's index instead of its pins."""

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        super().ensure_cache_available(request, num_computed_tokens)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        if super().has_cache_item(identifier):
            return True
        side = self._scheduler_side("has_cache_item")
        with contextlib.suppress(Exception):
            return bool(side._store.exists([identifier])[0])
        return False
