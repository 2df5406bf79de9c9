"""vLLM 0.33.0's encoder-cache connector interface, run from its wheel at test and benchmark
time.

``pip download vllm==0.33.0 --no-deps`` puts the wheel (336 MB) in a cache folder
(``~/.cache/embcache/vllm``, or the folder named by ``$EMBCACHE_VLLM_CACHE``; a wheel already
there is reused). ``install()`` executes these real modules out of the wheel (a zip), in this
order, and leaves them in ``sys.modules`` for the life of the process, so that
``embcache.integrations.vllm`` subclasses the real ``ECConnectorBase``:

    vllm/v1/outputs.py                                  (ECConnectorOutput)
    vllm/config/ec_transfer.py                          (ECTransferConfig)
    vllm/distributed/ec_transfer/ec_connector/base.py   (ECConnectorBase and its metadata)
    vllm/distributed/ec_transfer/ec_connector/factory.py
    vllm/distributed/ec_transfer/ec_transfer_state.py
    vllm/distributed/ec_transfer/__init__.py
    vllm/distributed/ec_transfer/ec_connector/utils.py  (ECOutputAggregator)
    vllm/v1/worker/ec_connector_model_runner_mixin.py   (the worker's per-step call order)

Their heavy imports get stand-ins: ``vllm.logger.init_logger`` is ``logging.getLogger``;
``vllm.config.utils.config`` is a plain dataclass (vLLM's is a pydantic one);
``SchedulerOutput`` is a plain object with the attributes the mixin reads
(``ec_connector_metadata``, ``finished_req_ids``); ``CUDAGraphStat`` is an empty class,
``PIN_MEMORY`` False, ``is_list_of`` an isinstance check. ``vllm_config`` and ``FakeRequest``
stand in for the ``VllmConfig`` and ``Request`` objects a connector reads (around vLLM's real
``ECTransferConfig``). Nothing of vLLM is copied here.

    python -m tests.support.vllm_wheel   # fetch the wheel and list the modules it runs
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from tests.support import wheels

VERSION = "0.33.0"
WIDTH = 64  # the hidden size of the stand-in model
CACHE_ENV = "EMBCACHE_VLLM_CACHE"
REAL_MODULES = (
    "vllm.v1.outputs",
    "vllm.config.ec_transfer",
    "vllm.distributed.ec_transfer.ec_connector.base",
    "vllm.distributed.ec_transfer.ec_connector.factory",
    "vllm.distributed.ec_transfer.ec_transfer_state",
    "vllm.distributed.ec_transfer",
    "vllm.distributed.ec_transfer.ec_connector.utils",
    "vllm.v1.worker.ec_connector_model_runner_mixin",
)
PACKAGES = (
    "vllm",
    "vllm.compilation",
    "vllm.config",
    "vllm.distributed",
    "vllm.distributed.ec_transfer",
    "vllm.distributed.ec_transfer.ec_connector",
    "vllm.utils",
    "vllm.v1",
    "vllm.v1.core",
    "vllm.v1.core.sched",
    "vllm.v1.worker",
)


_lock = threading.Lock()


class VLLMUnavailable(RuntimeError):
    """The vllm wheel could not be had, so nothing that needs vLLM's interface can run."""


class SchedulerOutput:
    """Stand-in for vLLM's ``SchedulerOutput``: the attributes the worker mixin reads."""

    def __init__(self, finished_req_ids: set[str] | None = None) -> None:
        self.ec_connector_metadata: Any = None
        self.finished_req_ids: set[str] = set() if finished_req_ids is None else finished_req_ids


def cache_dir() -> Path:
    """The folder that holds the wheel: ``$EMBCACHE_VLLM_CACHE`` or ~/.cache/embcache/vllm."""
    return wheels.cache_dir("vllm", CACHE_ENV)


def _how_to_get_it(folder: Path) -> str:
    return wheels.how_to_get_it("vllm", VERSION, CACHE_ENV, folder)


def wheel_path() -> Path:
    """The vllm wheel in ``cache_dir()``, downloaded there with pip if it is not there yet.

    Raises ``VLLMUnavailable`` (saying why, and how to get it) when pip cannot fetch it.
    """
    return wheels.fetch_wheel("vllm", VERSION, CACHE_ENV, VLLMUnavailable, timeout=1200)


def _module(name: str, *, package: bool = False) -> ModuleType:
    module = ModuleType(name)
    if package:
        module.__path__ = []
    module.__package__ = name if package else name.rpartition(".")[0]
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _is_list_of(value: object, typ: Any, *, check: str = "first") -> bool:
    return isinstance(value, list) and all(isinstance(v, typ) for v in value)


def _stand_ins() -> None:
    for name in PACKAGES:
        _module(name, package=True)
    _module("vllm.logger").init_logger = logging.getLogger  # type: ignore[attr-defined]
    _module("vllm.config.utils").config = dataclasses.dataclass  # type: ignore[attr-defined]
    sched_output = _module("vllm.v1.core.sched.output")
    sched_output.SchedulerOutput = SchedulerOutput  # type: ignore[attr-defined]
    cuda_graph = _module("vllm.compilation.cuda_graph")
    cuda_graph.CUDAGraphStat = type("CUDAGraphStat", (), {})  # type: ignore[attr-defined]
    _module("vllm.utils.torch_utils").PIN_MEMORY = False  # type: ignore[attr-defined]
    _module("vllm.utils.collection_utils").is_list_of = _is_list_of  # type: ignore[attr-defined]


def _path_of(name: str) -> str:
    path = name.replace(".", "/")
    return f"{path}/__init__.py" if name in PACKAGES else f"{path}.py"


def install() -> ModuleType:
    """Put vLLM's interface modules in ``sys.modules`` (once a process) and return its
    ``base`` module. Raises ``VLLMUnavailable`` when the wheel cannot be had or read."""
    with _lock:
        done = sys.modules.get(REAL_MODULES[2])
        if done is not None and getattr(done, "__file__", "").startswith(str(cache_dir())):
            return done
        if "vllm" in sys.modules and not hasattr(sys.modules["vllm"], "__embcache_stand_in__"):
            raise VLLMUnavailable("a real vllm is imported in this process already")
        wheel = wheel_path()
        try:
            with zipfile.ZipFile(wheel) as archive:
                sources = {name: archive.read(_path_of(name)) for name in REAL_MODULES}
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise VLLMUnavailable(
                f"{wheel} lacks a readable interface module ({exc}); delete it and "
                f"{_how_to_get_it(wheel.parent)}"
            ) from exc
        _stand_ins()
        sys.modules["vllm"].__embcache_stand_in__ = True  # type: ignore[attr-defined]
        for name in REAL_MODULES:
            module = sys.modules[name] if name in PACKAGES else _module(name)
            module.__file__ = f"{wheel}/{_path_of(name)}"
            exec(compile(sources[name], module.__file__, "exec"), module.__dict__)
        return sys.modules[REAL_MODULES[2]]


def install_or_skip() -> ModuleType:
    """``install()`` for a test: without the wheel in ``cache_dir()``, the test skips, saying
    how to get it, unless ``CI`` or ``EMBCACHE_VLLM_DOWNLOAD`` is set (then the wheel is
    downloaded); a wheel that cannot be had skips the test, and fails it in CI."""
    import os

    import pytest

    wheel_there = any(cache_dir().glob(f"vllm-{VERSION}-*.whl"))
    if not wheel_there and not (os.environ.get("CI") or os.environ.get("EMBCACHE_VLLM_DOWNLOAD")):
        pytest.skip(
            f"vLLM {VERSION}'s wheel is not in {cache_dir()}: set EMBCACHE_VLLM_DOWNLOAD=1 to let "
            "the tests fetch it (336 MB), or run `python -m tests.support.vllm_wheel`"
        )
    try:
        return install()
    except VLLMUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the vllm {VERSION} wheel must be had in CI: {exc}")
        pytest.skip(f"vLLM {VERSION}'s wheel cannot be had here: {exc}")


def vllm_config(
    role: str, extra: dict[str, Any], world_size: int, rank: int = 0, device: str = "cpu"
) -> Any:
    """A ``VllmConfig`` stand-in holding vLLM's real ``ECTransferConfig``; the ranks' tensors
    live on ``device``."""
    install()
    from vllm.config.ec_transfer import ECTransferConfig

    ec = ECTransferConfig(
        ec_connector="EmbcacheECConnector",
        ec_connector_module_path="embcache.integrations.vllm",
        ec_role=role,
        ec_connector_extra_config=dict(extra),
    )
    return SimpleNamespace(
        ec_transfer_config=ec,
        model_config=SimpleNamespace(dtype=torch.float16, get_hidden_size=lambda: WIDTH),
        parallel_config=SimpleNamespace(world_size=world_size, rank=rank),
        device_config=SimpleNamespace(device=device),
    )


@dataclass
class FakeRequest:
    """What the connector reads of vLLM's ``Request``."""

    request_id: str
    keys: list[str]
    rows: dict[str, int]
    steps_left: int
    mm_features: list[SimpleNamespace] = field(init=False)

    def __post_init__(self) -> None:
        self.mm_features = [self._feature(k) for k in self.keys]

    def _feature(self, key: str) -> SimpleNamespace:
        rows = self.rows[key]
        position = SimpleNamespace(get_num_embeds=lambda: rows)
        return SimpleNamespace(identifier=key, modality="image", mm_position=position)

    def add_item(self, key: str, rows: int) -> None:
        """Media that arrive after the request was first scheduled (a streamed input)."""
        self.keys.append(key)
        self.rows[key] = rows
        self.mm_features.append(self._feature(key))

    def get_num_encoder_embeds(self, index: int) -> int:
        return self.rows[self.keys[index]]


if __name__ == "__main__":
    base = install()
    print(f"vLLM {VERSION} interface from {wheel_path()}:")
    for name in REAL_MODULES:
        print(f"  {name}")
