"""Our controller has every public method of SGLang 0.5.23's own ``EmbeddingCacheController``,
with the same parameters, read from the real wheel (``tests.support.sglang_wheel``: downloaded
without dependencies, the module run with stand-ins for its SGLang imports).

Without the wheel the tests skip, saying why; in CI (``CI`` set) they fail instead, since
the wheel is downloadable there.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

from embcache.integrations.sglang import EmbeddingCacheController
from embcache.integrations.sglang_install import interface_differences
from embcache.testing import FaultInjectingStore
from tests.support.sglang_wheel import SGLangUnavailable, load_controller_module

pytestmark = pytest.mark.timeout(600)  # a first run downloads the wheel (about 40 MB)


@pytest.fixture(scope="module")
def sglang_class() -> type:
    try:
        controller: type = load_controller_module().EmbeddingCacheController
    except SGLangUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the sglang 0.5.23 wheel must be had in CI: {exc}")
        pytest.skip(
            f"sglang 0.5.23's wheel cannot be had here, so there is nothing to compare: {exc}"
        )
    return controller


def public_methods(cls: type) -> dict[str, Any]:
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") or name == "__init__"
    }


def shape(fn: Any) -> list[tuple[str, inspect._ParameterKind, str]]:
    """Parameters as names, kinds and defaults (SGLang's annotations are its own objects)."""
    return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]


def test_every_public_method_of_sglang_has_the_same_signature_here(sglang_class: type) -> None:
    theirs = public_methods(sglang_class)
    ours = public_methods(EmbeddingCacheController)
    assert {
        "__init__",
        "prefetch",
        "check_prefetch_progress",
        "batch_is_exist",
        "has_local_embedding",
        "store_to_pool_async",
        "wait_store_to_pool",
        "insert_batch",
        "get_embedding_dim",
        "get_pool_views",
        "release_pool_views",
        "load_to_device_async",
        "wait_load_to_device",
        "get_stats",
    } <= set(theirs), sorted(theirs)  # the loader read the controller we expect
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"methods of SGLang's controller missing here: {missing}"
    differing = {
        name: (shape(fn), shape(ours[name]))
        for name, fn in theirs.items()
        if shape(fn) != shape(ours[name])
        or inspect.iscoroutinefunction(fn) != inspect.iscoroutinefunction(ours[name])
    }
    assert not differing, f"(SGLang's, ours) per method: {differing}"
    assert interface_differences(sglang_class, EmbeddingCacheController) == []


def test_the_interface_check_names_a_changed_or_missing_method(sglang_class: type) -> None:
    class Changed(sglang_class):  # type: ignore[misc,valid-type]
        def get_pool_views(self, mm_hashes: list[str], extra: int = 0) -> None: ...

        async def has_local_embedding(self, mm_hash: str) -> bool: ...

        def get_stats_v2(self) -> None: ...

    differences = interface_differences(Changed, EmbeddingCacheController)
    assert any(
        d.startswith("get_pool_views: SGLang has (self, mm_hashes, extra=0)") for d in differences
    )
    assert "has_local_embedding: async in one, not in the other" in differences
    assert "get_stats_v2: missing" in differences
    assert len(differences) == 3, differences


def test_an_instance_has_the_attributes_mmencoder_reads(sglang_class: type) -> None:
    ctl = EmbeddingCacheController(
        FaultInjectingStore(),
        max_pool_size_gb=1 / 1024,
        hidden_dims={"IMAGE": 8},
        dtype=torch.bfloat16,
    )
    try:
        assert ctl.prefetch_tp_group is None  # one rank: MMEncoder broadcasts only when TP > 1
        assert (ctl.tp_world_size, ctl.tp_rank, ctl.all_rank_get) == (1, 0, False)
        assert ctl.dtype is torch.bfloat16
    finally:
        ctl.close()
