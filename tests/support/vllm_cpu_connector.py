"""vLLM 0.33.0's own ``ECCPUConnector`` (``vllm/distributed/ec_transfer/ec_connector/cpu/``),
run from its wheel on a machine without CUDA: the baseline of ``benchmarks/peers/bench_vllm.py``
and the contender the call-order tests run beside ours (``contender``).

``install()`` executes these modules of the wheel, unchanged, after ``vllm_wheel.install()``:

    vllm/distributed/ec_transfer/ec_connector/encoder_output_width.py
    vllm/distributed/ec_transfer/ec_connector/cpu/{ec_shared_region,common}.py
    vllm/distributed/ec_transfer/ec_connector/cpu/scheduler/{embedding_cache,__init__}.py
    vllm/distributed/ec_transfer/ec_connector/cpu/worker/{descriptor_buffers,__init__}.py
    vllm/distributed/ec_transfer/ec_connector/cpu/connector.py

What is replaced, and only on the worker side (the scheduler side runs as shipped):

- ``vllm._custom_ops.swap_blocks_batch`` (a CUDA copy kernel over descriptor lists) is a CPU
  copy: one ``ctypes.memmove`` per descriptor (``cpu_swap_blocks_batch``);
- ``current_platform``'s streams are no-op objects (``Stream()``, ``current_stream()``,
  ``stream(s)`` as a null context, ``wait_stream`` a no-op), its ``device_type`` is "cpu";
- the worker's timing events (``torch.Event``) are no-op events that have always fired
  (``record`` does nothing, ``query()`` is True, ``elapsed_time`` 0), through the worker's own
  ``_acquire_event`` seam, and ``Tensor.record_stream`` is a no-op while a worker method runs
  (CPU tensors have no streams);
- ``get_tensor_model_parallel_rank()`` is the rank being built, ``get_pcp_group()`` rank 0,
  ``is_pin_memory_available()`` False.

So a copy is done when ``save_caches``/``start_load_caches`` return, as a synchronised CUDA copy
would be; the scheduler sees every completion in the same step's worker metadata.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import zipfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from tests.support import vllm_wheel

PREFIX = "vllm.distributed.ec_transfer.ec_connector."
MODULES = (
    ("encoder_output_width", False),
    ("cpu", True),
    ("cpu.ec_shared_region", False),
    ("cpu.common", False),
    ("cpu.scheduler.embedding_cache", False),
    ("cpu.scheduler", True),
    ("cpu.worker.descriptor_buffers", False),
    ("cpu.worker", True),
    ("cpu.connector", False),
)
_rank = [0]  # the rank of the worker being built


def cpu_swap_blocks_batch(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, **_: Any
) -> None:
    """``swap_blocks_batch`` on the CPU: copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to
    ``dst_ptrs[i]``."""
    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(dst, src, size)


class NoOpStream:
    """A stream that orders nothing (a CPU copy is done when it returns)."""

    def wait_stream(self, other: object) -> None:
        return None


class NoOpEvent:
    """A timing event that has always fired."""

    def record(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: object) -> float:
        return 0.0


def _platform() -> SimpleNamespace:
    return SimpleNamespace(
        device_type="cpu",
        Stream=NoOpStream,
        current_stream=NoOpStream,
        stream=lambda s: contextlib.nullcontext(),
        is_xpu=lambda: False,
    )


def _stand_ins() -> None:
    mod = vllm_wheel._module
    mod("vllm._custom_ops").swap_blocks_batch = cpu_swap_blocks_batch  # type: ignore[attr-defined]
    parallel = mod("vllm.distributed.parallel_state")
    parallel.get_tensor_model_parallel_rank = lambda: _rank[0]  # type: ignore[attr-defined]
    parallel.get_pcp_group = lambda: SimpleNamespace(rank_in_group=0)  # type: ignore[attr-defined]
    mod("vllm.platforms").current_platform = _platform()  # type: ignore[attr-defined]
    utils = mod("vllm.utils.platform_utils")
    utils.is_pin_memory_available = lambda: False  # type: ignore[attr-defined]


def install() -> Any:
    """Load the modules above (once a process); returns the ``ECCPUConnector`` class."""
    vllm_wheel.install()
    name = PREFIX + "cpu.connector"
    if name in sys.modules:
        return sys.modules[name].ECCPUConnector
    _stand_ins()
    with zipfile.ZipFile(vllm_wheel.wheel_path()) as archive:
        for short, package in MODULES:
            full = PREFIX + short
            path = full.replace(".", "/") + ("/__init__.py" if package else ".py")
            module = vllm_wheel._module(full, package=package)
            module.__file__ = f"{vllm_wheel.wheel_path()}/{path}"
            exec(compile(archive.read(path), module.__file__, "exec"), module.__dict__)
    return sys.modules[name].ECCPUConnector


@contextlib.contextmanager
def cpu_streams() -> Iterator[None]:
    """``Tensor.record_stream`` a no-op while ECCPU's worker code runs."""
    saved = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        torch.Tensor.record_stream = saved  # type: ignore[method-assign]


def config(cpu_bytes: int, world: int, width: int, rank: int = 0, role: str = "ec_both") -> Any:
    """A ``VllmConfig`` stand-in for ``ECCPUConnector``: the attributes it reads."""
    install()
    from vllm.config.ec_transfer import ECTransferConfig

    ec = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,
        ec_connector_extra_config={"ec_cpu_bytes": cpu_bytes},
    )
    ec.mm_encoder_output_widths = {"image": width}
    return SimpleNamespace(
        ec_transfer_config=ec,
        use_v2_model_runner=True,
        instance_id=f"eccpu-baseline-{id(ec)}",  # its region: /dev/shm/vllm_ec_<this>_dp0.mmap
        model_config=SimpleNamespace(
            dtype=torch.float16,
            get_hidden_size=lambda: width,
            get_inputs_embeds_size=lambda: width,
        ),
        parallel_config=SimpleNamespace(
            world_size=world,
            rank=rank,
            data_parallel_index=0,
            tensor_parallel_size=world,
            prefill_context_parallel_size=1,
            distributed_executor_backend="mp",
        ),
        device_config=SimpleNamespace(device="cpu"),
    )


def make(cpu_bytes: int, world: int, width: int) -> tuple[Any, list[Any]]:
    """A scheduler-role ``ECCPUConnector`` and one worker-role connector per rank, all over
    one shared region (the workers' ``_acquire_event`` gives no-op events)."""
    connector = install()
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    cfg = config(cpu_bytes, world, width)
    scheduler = connector(cfg, ECConnectorRole.SCHEDULER)
    workers = []
    for rank in range(world):
        _rank[0] = rank
        worker = connector(cfg, ECConnectorRole.WORKER)
        worker.connector_worker._acquire_event = NoOpEvent
        workers.append(worker)
    return scheduler, workers


def contender(
    name: str, pool_bytes: int, policy: str = "lru", width: int = 1024
) -> tuple[Any, list[Any], contextlib.AbstractContextManager[None]]:
    """A scheduler-role connector, one worker-role connector per rank (2 ranks) and a context
    that runs the engine and shuts them down: ``embcache`` (``EmbcacheECConnector`` with
    ``pool_bytes``, ``policy`` and ``embed_width=width``) or ``eccpu`` (vLLM's
    ``ECCPUConnector`` with ``ec_cpu_bytes=pool_bytes``, ``make``)."""
    vllm_wheel.install()
    if name == "eccpu":
        scheduler, workers = make(pool_bytes, 2, width)
    else:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        extra = {"pool_bytes": pool_bytes, "embed_width": width, "policy": policy}
        create = ECConnectorFactory.create_connector
        config = vllm_wheel.vllm_config
        scheduler = create(config("ec_both", extra, 2), ECConnectorRole.SCHEDULER)
        role = ECConnectorRole.WORKER
        workers = [create(config("ec_both", extra, 2, r), role) for r in (0, 1)]

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        try:
            with cpu_streams():
                yield
        finally:
            scheduler.shutdown()
            for worker in workers:
                worker.shutdown()

    return scheduler, workers, running()
