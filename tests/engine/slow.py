"""Connectors for the engine tier's worker-death test (``tests/engine/test_worker_death.py``).

``SlowRank0ECConnector`` is ``EmbcacheECConnector`` with a rank 0 that is slow for ever, as
far as the scheduler can tell: it writes every fresh encoder output into the pool range the
scheduler reserved, and never sends the ack of it. Its loads' acks and its first acks (the
process it runs in) go as usual. So every fill becomes overdue ``hold_timeout_s`` after its
request ended: it ends UNKNOWN, its range quarantined, and stays ``writing`` until rank 0's
process is seen gone. Only the worker role differs; the scheduler role is the connector's own.

``FreeOnTimeoutECConnector`` is the plant "free on a timeout": the same, with the scheduler's
cache made without its fence gate, so a fence frees an overdue fill's range at once, its
writer presumed dead because its ack is late (the connector's rule before it knew dead from
slow; the unit tier's plant of the same name, in ``tests/vllm_connector/test_vllm_dead_ranks.py``).
The worker-death check must fail with it.

    ec_transfer_config: {"ec_connector": "SlowRank0ECConnector",
                         "ec_connector_module_path": "tests.engine.slow", ...}
"""

from __future__ import annotations

from typing import Any

from embcache.integrations.vllm import EmbcacheECConnector, EmbcacheECWorkerMetadata

__all__ = ["FreeOnTimeoutECConnector", "SlowRank0ECConnector"]


class SlowRank0ECConnector(EmbcacheECConnector):
    """``EmbcacheECConnector`` whose rank 0 never acks a save (module docstring)."""

    def build_connector_worker_meta(self) -> Any:
        acks = super().build_connector_worker_meta()
        if not isinstance(acks, EmbcacheECWorkerMetadata) or not acks.saved:
            return acks
        kept = EmbcacheECWorkerMetadata(acks.loaded, {}, acks.alive)
        return kept if kept.loaded or kept.alive else None


class FreeOnTimeoutECConnector(SlowRank0ECConnector):
    """The plant "free on a timeout" (module docstring): the scheduler's cache has no fence
    gate."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        from embcache.integrations.vllm import scheduler

        made = scheduler.EmbeddingCache

        def without_gate(*args: Any, **kwargs: Any) -> Any:
            return made(*args, **{**kwargs, "fence_gate": None})

        scheduler.EmbeddingCache = without_gate  # type: ignore[assignment,misc]
        try:
            super().__init__(vllm_config, role)
        finally:
            scheduler.EmbeddingCache = made  # type: ignore[misc]
