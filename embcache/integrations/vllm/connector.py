"""``EmbcacheECConnector``: vLLM's encoder-cache connector interface over embcache.

vLLM builds it twice: with ``ECConnectorRole.SCHEDULER`` in the engine core (the methods of
``SchedulerSide``) and with ``WORKER`` in every rank (``WorkerSide``); each method checks that
it runs in its role. Loaded with::

    --ec-transfer-config '{"ec_connector": "EmbcacheECConnector",
        "ec_connector_module_path": "embcache.integrations.vllm", "ec_role": "ec_both"}'

Options come from ``ec_connector_extra_config`` (``embcache.integrations.vllm.options``).
At import time only vLLM's ``ec_connector/base.py`` is needed; the rest of vLLM's config is
read from the ``vllm_config`` object at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from embcache import Item
from embcache.errors import InvalidArgumentError, InvalidTypeError
from embcache.integrations.vllm.options import parse_options
from embcache.integrations.vllm.protocol import EmbcacheECMetadata, EmbcacheECWorkerMetadata
from embcache.integrations.vllm.scheduler import SchedulerSide, SchedulerStats
from embcache.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["EmbcacheECConnector"]
MAX_MODALITIES = 64  # widths remembered (vLLM has a handful of modalities)


class EmbcacheECConnector(ECConnectorBase):  # type: ignore[misc]
    """The connector (module docstring); ``role`` picks which half runs here.

    ``has_cache_item(identifier)`` is True only for an item the request being scheduled holds
    pinned READY. vLLM asks it once per scheduled item, so it is a slot, not a method: in the
    scheduler role it holds the current request's own ``dict.__contains__`` (rebound whenever
    the current request changes), read by a C-level member descriptor and called without a
    Python frame; in the worker role it raises ``InvalidArgumentError``."""

    __slots__ = (
        "_dtype",
        "_hidden",
        "_scheduler",
        "_width",
        "_width_by_modality",
        "_widths",
        "_worker",
        "has_cache_item",
    )  # fmt: skip
    has_cache_item: Callable[[str], bool]

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        ec_config = vllm_config.ec_transfer_config
        options = parse_options(ec_config.ec_connector_extra_config)
        self._dtype: torch.dtype = vllm_config.model_config.dtype
        self._widths: dict[str, int] = dict(getattr(ec_config, "mm_encoder_output_widths", {}))
        self._width = options.embed_width
        self._hidden = vllm_config.model_config.get_hidden_size
        self._width_by_modality: dict[str, int] = {}  # the widths found so far
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        parallel = vllm_config.parallel_config
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                options,
                parallel.world_size,
                consumer=self.is_consumer,
                producer=self.is_producer,
            )
            self.has_cache_item = self._scheduler.has_item
        else:
            self._worker = WorkerSide(parallel.rank, torch.device(vllm_config.device_config.device))
            self.has_cache_item = self._not_in_worker_role

    # -- the two halves ------------------------------------------------------------------
    @property
    def scheduler_side(self) -> SchedulerSide:
        """The scheduler-side half (vLLM's word for the methods that run in the scheduler):
        its ``cache`` (the ``EmbeddingCache`` over the shared pool: ``stats()``,
        ``entry_state``, ``snapshot()``), ``stats()``, ``sizes()``, ``holds()``. Raises
        ``InvalidArgumentError`` in the worker role."""
        return self._scheduler_side("scheduler_side")

    @property
    def worker_side(self) -> WorkerSide:
        """The worker-side half of one rank (``WorkerSide``). Raises ``InvalidArgumentError``
        in the scheduler role."""
        return self._worker_side("worker_side")

    # -- scheduler role ------------------------------------------------------------------
    def _not_in_worker_role(self, identifier: str) -> bool:
        """``has_cache_item`` in the worker role: ``InvalidArgumentError``."""
        return self._scheduler_side("has_cache_item").has_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Look the request's items up (once, and again for items that arrived since); False
        defers it while a store read runs."""
        side = self._scheduler or self._scheduler_side("ensure_cache_available")
        ready = side.ensure_known(request.request_id, len(request.mm_features))
        if ready is None:
            ready = side.ensure(request.request_id, self._items(request))
        self.has_cache_item = side.has_item
        return ready

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Item ``index`` of ``request`` is scheduled: a load if held, else maybe a fill."""
        side = self._scheduler or self._scheduler_side("update_state_after_alloc")
        side.alloc(request.request_id, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads and saves, for every rank."""
        side = self._scheduler or self._scheduler_side("build_connector_meta")
        meta = side.build()
        self.has_cache_item = side.has_item
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """The ranks' merged acks."""
        acks = connector_output.ec_connector_worker_meta
        if isinstance(acks, EmbcacheECWorkerMetadata):
            side = self._scheduler or self._scheduler_side("update_connector_output")
            side.absorb(acks)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's pins now or when its last ack comes; vLLM frees at once."""
        side = self._scheduler or self._scheduler_side("request_finished")
        side.finish(request.request_id)
        self.has_cache_item = side.has_item
        return False, None

    def stats(self) -> SchedulerStats:
        """The scheduler role's counters (``SchedulerStats``)."""
        return self._scheduler_side("stats").stats()

    def check_invariants(self) -> None:
        """The cache's and the connector's invariants (``SchedulerSide.check_invariants``)."""
        self._scheduler_side("check_invariants").check_invariants()

    # -- worker role ---------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Copy this step's loads from the shared pool into ``encoder_cache``."""
        side = self._worker_side("start_load_caches")
        side.load(self._step_metadata(), encoder_cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Rank 0: copy a fresh output into the pool range this step reserved for it."""
        side = self._worker_side("save_caches")
        side.save(self._step_metadata(), encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """This rank's acks since the last step (rank 0: a save of this step it was not
        asked to write is acked as failed, so its range is freed)."""
        meta = self._connector_metadata
        step = meta if isinstance(meta, EmbcacheECMetadata) else None
        return self._worker_side("build_connector_worker_meta").acks(step)

    def shutdown(self) -> None:
        """Scheduler: release everything, close the cache, store and shared pool."""
        if self._scheduler is not None:
            self._scheduler.close()

    # -- helpers -------------------------------------------------------------------------
    def _items(self, request: Request) -> list[Item]:
        """The request's items by vLLM item index: rows x width of the model's dtype."""
        widths, dtype, item = self._width_by_modality, self._dtype, Item.of_matrix
        return [
            item(
                f.identifier,
                request.get_num_encoder_embeds(i),
                widths.get(f.modality) or self._width_of(f.modality),
                dtype,
            )
            for i, f in enumerate(request.mm_features)
        ]

    def _width_of(self, modality: str) -> int:
        width = int(self._width or self._widths.get(modality) or self._hidden())
        if len(self._width_by_modality) < MAX_MODALITIES:
            self._width_by_modality[modality] = width
        return width

    def _step_metadata(self) -> EmbcacheECMetadata:
        meta = self._connector_metadata
        if not isinstance(meta, EmbcacheECMetadata):
            raise InvalidTypeError(
                f"the bound connector metadata is {type(meta).__name__}, not EmbcacheECMetadata: "
                "bind_connector_metadata with what this connector's scheduler built"
            )
        return meta

    def _scheduler_side(self, method: str) -> SchedulerSide:
        """The scheduler half; ``InvalidArgumentError`` in the worker role. vLLM's per-step
        methods read ``self._scheduler or self._scheduler_side(...)``: no frame of this one
        per call while the half exists."""
        if self._scheduler is None:
            raise InvalidArgumentError(
                f"{method} is a scheduler-role method, called on the {self.role} connector"
            )
        return self._scheduler

    def _worker_side(self, method: str) -> WorkerSide:
        if self._worker is None:
            raise InvalidArgumentError(
                f"{method} is a worker-role method, called on the {self.role} connector"
            )
        return self._worker
