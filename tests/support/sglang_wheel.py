"""SGLang 0.5.23's paged embedding cache controller, obtained at benchmark time.

The peer runs its own code: ``pip download sglang==0.5.23 --no-deps`` puts the wheel in a cache
folder (``~/.cache/embcache/sglang``, or the folder named by ``$EMBCACHE_SGLANG_CACHE``; a wheel
already there is reused, nothing is fetched), the module file
``sglang/srt/mem_cache/embedding_cache_controller.py`` is read out of the wheel (a zip) and
executed as a module. Nothing of SGLang is copied into this repository.

The module imports four things from SGLang besides torch; each gets a stand-in, present in
``sys.modules`` only while the module executes (what was there before is put back):
``sgl_kernel.kvcacheio`` is made unimportable (the module then copies with torch, its own CPU
path), ``Modality`` is an enum with the members the controller reads, ``EmbeddingStore`` is an
empty class (used only in annotations), and ``get_parallel()`` answers one rank of a TP group of
one (``tp_size`` 1, no process group), the case in which the controller never touches
``torch.distributed``.

``make_controller`` builds an ``EmbeddingCacheController`` whose vision pool holds about
``pool_bytes`` (the controller gives 80% of its budget to vision, 20% to audio) with pages of
about ``page_bytes`` (SGLang's own default is 256 KiB), backed by a store that holds nothing.
The only override is the pinning of the pool: the controller always asks for pinned memory,
which a host without CUDA cannot give, so there it gets plain memory.

    python -m tests.support.sglang_wheel   # fetch the wheel and print where the module came from
"""

from __future__ import annotations

import enum
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from tests.support import wheels

VERSION = "0.5.23"
MODULE_FILE = "sglang/srt/mem_cache/embedding_cache_controller.py"
MODULE_NAME = "embcache_bench_sglang_embedding_cache_controller"
CACHE_ENV = "EMBCACHE_SGLANG_CACHE"
DEFAULT_PAGE_BYTES = 256 * 1024

_lock = threading.Lock()
_loaded: ModuleType | None = None


class SGLangUnavailable(RuntimeError):
    """The sglang wheel could not be had, so the rows against SGLang cannot run."""


def cache_dir() -> Path:
    """The folder that holds the wheel: ``$EMBCACHE_SGLANG_CACHE`` or ~/.cache/embcache/sglang."""
    return wheels.cache_dir("sglang", CACHE_ENV)


def _how_to_get_it(folder: Path) -> str:
    return wheels.how_to_get_it("sglang", VERSION, CACHE_ENV, folder)


def wheel_path() -> Path:
    """The sglang wheel in ``cache_dir()``, downloaded there with pip if it is not there yet.

    Raises ``SGLangUnavailable`` (saying why, and how to get it) when pip cannot fetch it.
    """
    return wheels.fetch_wheel("sglang", VERSION, CACHE_ENV, SGLangUnavailable, timeout=600)


def _stand_ins() -> dict[str, ModuleType | None]:
    """The modules the controller imports from SGLang, as the least that lets it run."""

    class Modality(enum.Enum):
        IMAGE = enum.auto()
        MULTI_IMAGES = enum.auto()
        VIDEO = enum.auto()
        AUDIO = enum.auto()

    class EmbeddingStore:
        """Stand-in for ``sglang.srt.mem_cache.embedding_store.EmbeddingStore`` (annotations)."""

    def get_parallel() -> SimpleNamespace:
        return SimpleNamespace(tp_size=1, tp_rank=0, tp_group=SimpleNamespace(cpu_group=None))

    modules: dict[str, ModuleType | None] = {"sgl_kernel": None}  # None: import raises
    for name in (
        "sglang",
        "sglang.srt",
        "sglang.srt.managers",
        "sglang.srt.mem_cache",
        "sglang.srt.managers.schedule_batch",
        "sglang.srt.mem_cache.embedding_store",
        "sglang.srt.runtime_context",
    ):
        module = ModuleType(name)
        module.__path__ = []  # a package, so that submodule imports resolve
        modules[name] = module
    modules["sglang.srt.managers.schedule_batch"].Modality = Modality  # type: ignore[union-attr]
    modules["sglang.srt.mem_cache.embedding_store"].EmbeddingStore = (  # type: ignore[union-attr]
        EmbeddingStore
    )
    modules["sglang.srt.runtime_context"].get_parallel = get_parallel  # type: ignore[union-attr]
    return modules


@contextmanager
def _installed(modules: dict[str, ModuleType | None]) -> Iterator[None]:
    """``modules`` in ``sys.modules`` for the duration; what was there before is put back."""
    missing = object()
    before = {name: sys.modules.get(name, missing) for name in modules}
    sys.modules.update(modules)  # type: ignore[arg-type]
    try:
        yield
    finally:
        for name, old in before.items():
            if old is missing:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old  # type: ignore[assignment]


def load_controller_module() -> Any:
    """SGLang 0.5.23's ``embedding_cache_controller`` module, run from the wheel (once a
    process). Raises ``SGLangUnavailable`` when the wheel cannot be had or read."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        wheel = wheel_path()
        try:
            with zipfile.ZipFile(wheel) as archive:
                source = archive.read(MODULE_FILE)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise SGLangUnavailable(
                f"{wheel} has no readable {MODULE_FILE} ({exc}); delete it and "
                f"{_how_to_get_it(wheel.parent)}"
            ) from exc
        module = ModuleType(MODULE_NAME)
        module.__file__ = f"{wheel}/{MODULE_FILE}"
        sys.modules[MODULE_NAME] = module  # dataclasses look their module up while defined
        try:
            with _installed(_stand_ins()):
                exec(compile(source, module.__file__, "exec"), module.__dict__)
        except BaseException:
            del sys.modules[MODULE_NAME]
            raise
        _loaded = module
        return module


class NullStore:
    """A global store that holds nothing: every key is missing, every get fails, every put
    succeeds (and is dropped). Enough for the controller's local paths."""

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Accept the pool (a real store would register it for RDMA)."""

    def batch_is_exist(self, keys: list[str]) -> list[bool]:
        """No key exists."""
        return [False] * len(keys)

    def batch_get_into_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Every get fails (nothing is held)."""
        return [False] * len(keys)

    def batch_put_from_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Every put succeeds and is dropped."""
        return [True] * len(keys)


def make_controller(
    pool_bytes: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    page_bytes: int = DEFAULT_PAGE_BYTES,
    max_eviction_batch: int = 100,
    store: Any = None,
) -> Any:
    """An ``EmbeddingCacheController`` whose vision pool holds about ``pool_bytes`` (at most
    ``pool_bytes``, whole pages of about ``page_bytes``), ``store`` (default ``NullStore()``)
    as its global store. Its IO thread runs, as in SGLang: ``stop_io`` ends it."""
    module = load_controller_module()
    ratio = module.VISION_POOL_RATIO
    total_gb = (pool_bytes + 1) / ratio / 2**30  # int() of the controller's math lands on it

    class Controller(module.EmbeddingCacheController):  # type: ignore[name-defined,misc]
        def _create_pools(self, pin_memory: bool) -> Any:
            return super()._create_pools(pin_memory and torch.cuda.is_available())

    with _lock:  # the page size is a module constant, read when the pools are made
        saved = module.TARGET_PAGE_BYTES
        module.TARGET_PAGE_BYTES = page_bytes
        try:
            return Controller(
                store if store is not None else NullStore(),
                max_pool_size_gb=total_gb,
                hidden_dims={module.Modality.IMAGE: dim},
                max_eviction_batch=max_eviction_batch,
                dtype=dtype,
            )
        finally:
            module.TARGET_PAGE_BYTES = saved


def stop_io(controller: Any) -> None:
    """End the controller's IO thread (it polls its queues every millisecond)."""
    controller.stop_event.set()
    controller.io_thread.join()


def image_modality() -> Any:
    """The ``Modality.IMAGE`` the loaded controller compares against."""
    return load_controller_module().Modality.IMAGE


class SGLangPeer:
    """SGLang's controller with pages of about ``page_bytes``, driven through its own methods as
    its scheduler drives it: ``batch_is_exist``, ``prefetch``, ``get_pool_views`` and
    ``release_pool_views``, and an insert as ``store_to_pool_async`` makes it."""

    def __init__(self, pool_bytes: int, dim: int, dtype: torch.dtype, page_bytes: int) -> None:
        self.module = load_controller_module()
        self.controller = make_controller(pool_bytes, dim, dtype, page_bytes)
        stop_io(self.controller)
        self.pool = self.controller.vision_pool
        self.image = image_modality()

    def exists(self, keys: list[str]) -> list[bool]:
        """``batch_is_exist``, driven without an event loop: all keys must be local."""
        coroutine = self.controller.batch_is_exist(keys)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return list(done.value)
        coroutine.close()
        raise RuntimeError("batch_is_exist awaited the global store: drive local hits only")

    def prefetch(self, request_id: str, keys: list[str], tokens: list[int]) -> None:
        self.controller.prefetch(request_id, keys, tokens, self.image)

    def progress(self, request_id: str) -> bool:
        return bool(self.controller.check_prefetch_progress(request_id))

    def get(self, keys: list[str]) -> list[Any]:
        return list(self.controller.get_pool_views(keys))

    def release(self, keys: list[str]) -> None:
        self.controller.release_pool_views(keys)

    def insert(self, key: str, tensor: torch.Tensor) -> bool:
        """``store_to_pool_async`` + ``wait_store_to_pool`` for one CPU tensor; False when the
        controller skips it (present, or no pages)."""
        controller, pool, module = self.controller, self.pool, self.module
        rows = tensor.view(pool.dtype).view(-1, pool.dim)
        with controller.lock:
            if key in controller.entries:
                controller._lru_touch(key)
                return False
            runs = controller._allocate_with_eviction(pool, rows.shape[0])
            if runs is None:
                return False
            entry = module.EmbeddingCacheEntry(
                hash=key,
                modality=self.image,
                num_tokens=rows.shape[0],
                dim=pool.dim,
                page_runs=runs,
                state=module.EntryState.FILLING,
            )
            controller.entries[key] = entry
        controller._copy_embedding_page_runs(
            src=rows, dst=pool.tensor, entry=entry, pool=pool, src_is_pool=False
        )
        with controller.lock:
            if controller.entries.get(key) is entry and entry.state == module.EntryState.FILLING:
                controller._mark_ready(entry)
        return True


if __name__ == "__main__":
    loaded = load_controller_module()
    print(f"{loaded.__name__} from {loaded.__file__}")
    controller = make_controller(4 << 20, 14, torch.uint8, page_bytes=1024)
    pool = controller.vision_pool
    print(f"4 MiB pool, 1 KiB pages: {pool.num_pages} pages of {pool.page_bytes} B")
    stop_io(controller)
