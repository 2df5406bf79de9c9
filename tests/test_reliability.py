"""Issue 16: the cache fences by itself, exact recency, I/O-thread errors end their transfers,
``Request.publish``, and the poison debug mode that makes reads after release visible."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import torch

import embcache.driver.runner as runner_module
from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.core.lifecycle import ABSENT, QUARANTINED
from embcache.driver.fencing import FencePolicy
from embcache.driver.poison import POISON
from embcache.errors import InvalidArgumentError, InvalidTypeError, LockOrderError
from embcache.testing import Fault, FaultInjectingStore
from tests.support.helpers import evict_idle_after_close, item_of, payload, raw, wait_until

FAST = FencePolicy(max_fraction=1.0, max_age_s=0.2, min_interval_s=0.05, check_interval_s=0.05)
WAIT_S = 10.0


def quarantine(cache: EmbeddingCache, store: FaultInjectingStore, key: str) -> None:
    """Leave ``key``'s range QUARANTINED: its store read ends UNKNOWN."""
    tensor = payload((64,), torch.float32, 1)
    store.put_object(key, raw(tensor))
    store.inject(key, Fault.UNKNOWN)
    with cache.request(f"load-{key}") as request:
        request.lookup([item_of(key, tensor)])
        assert request.wait(WAIT_S)
    store.inject(key, None)


# ------------------------------------------------------------------ fencing by the cache itself
BY_BYTES = FencePolicy(max_fraction=0.0, max_age_s=3600, min_interval_s=0.05,
                      check_interval_s=0.05)  # fmt: skip


@pytest.mark.parametrize(
    "policy", [FAST, BY_BYTES], ids=["a quarantine gets old", "too much is quarantined"]
)
def test_the_cache_fences_by_itself(
    make_cache: Callable[..., EmbeddingCache], store: FaultInjectingStore, policy: FencePolicy
) -> None:
    cache = make_cache(auto_fence=policy)
    quarantine(cache, store, "q")
    wait_until(lambda: cache.entry_state("q") is ABSENT, "the automatic fence")
    stats = cache.stats()
    assert stats.fences >= 1 and stats.allocated_bytes == 0
    cache.check_invariants()


def test_an_unknown_publish_is_fenced_by_itself_too(
    make_cache: Callable[..., EmbeddingCache], store: FaultInjectingStore
) -> None:
    cache = make_cache(auto_fence=FAST)
    tensor = payload((64,), torch.float32, 2)
    store.inject("p", Fault.UNKNOWN)
    with cache.request("r") as request:
        request.insert(["p"], [tensor])
        wait_until(lambda: cache.stats().publishes_unknown == 1, "the publish to end")
    wait_until(lambda: cache.entry_state("p") is ABSENT, "the automatic fence")


def test_without_auto_fence_only_fence_frees_the_quarantine(
    make_cache: Callable[..., EmbeddingCache], store: FaultInjectingStore
) -> None:
    cache = make_cache(auto_fence=None)
    quarantine(cache, store, "q")
    with pytest.raises(AssertionError):
        wait_until(lambda: cache.entry_state("q") is ABSENT, "no fence", timeout_s=0.5)
    assert cache.fence() == 1 and cache.entry_state("q") is ABSENT


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_fraction": 1.5}, "max_fraction must be within"),
        ({"max_age_s": 0}, "max_age_s must be a finite number > 0"),
        ({"min_interval_s": float("inf")}, "min_interval_s must be a finite number > 0"),
        ({"check_interval_s": "1"}, "check_interval_s must be a finite number > 0"),
    ],
)
def test_a_bad_fence_policy_is_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        FencePolicy(**kwargs)  # type: ignore[arg-type]


def test_auto_fence_must_be_a_policy(make_cache: Callable[..., EmbeddingCache]) -> None:
    with pytest.raises(InvalidTypeError, match="auto_fence must be a FencePolicy"):
        make_cache(auto_fence=1.0)


# ------------------------------------------------------------------ exact recency
def fill(cache: EmbeddingCache, keys: list[str]) -> dict[str, Item]:
    items = {}
    for key in keys:
        tensor = payload((64,), torch.float32, len(items))
        with cache.request(f"fill-{key}") as request:
            request.insert([key], [tensor], publish=False)
        items[key] = item_of(key, tensor)
    return items


def order(cache: EmbeddingCache) -> list[str]:
    return cache.snapshot().eviction_order


def test_a_lookup_that_pins_nothing_leaves_the_order_alone(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache(4096, alignment=256)
    fill(cache, ["a", "b", "c"])
    assert order(cache) == ["a", "b", "c"]
    with cache.request("r") as request:
        statuses = request.lookup([Item("a", (8,), torch.float16)], prefetch=False)
        assert statuses[0].reason is not None and statuses[0].reason.value == "mismatch"
    assert order(cache) == ["a", "b", "c"], "a miss refreshed the recency of a"


def test_a_request_releases_its_pins_in_lookup_order(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache(4096, alignment=256)
    items = fill(cache, ["a", "b", "c"])
    with cache.request("r") as request:
        request.lookup([items["c"], items["a"], items["b"], items["c"]], prefetch=False)
    assert order(cache) == ["c", "a", "b"], "the last looked up must end newest"


# ------------------------------------------------------------------ errors on I/O threads
def test_an_error_on_an_io_thread_ends_the_load_and_wakes_its_waiters(
    make_cache: Callable[..., EmbeddingCache],
    store: FaultInjectingStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = runner_module.assert_unlocked

    def broken(what: str) -> None:
        if what == "store get_into":
            raise LockOrderError("store get_into while holding cache lock (injected)")
        real(what)

    monkeypatch.setattr(runner_module, "assert_unlocked", broken)
    cache = make_cache(auto_fence=None)
    tensor = payload((64,), torch.float32, 3)
    store.put_object("k", raw(tensor))
    with caplog.at_level(logging.ERROR, "embcache.driver.runner"), cache.request("r") as request:
        request.lookup([item_of("k", tensor)])
        assert request.wait(WAIT_S), "the waiter of a load whose worker raised was never woken"
        assert request.fallback_reasons()[0] is not None
    assert cache.entry_state("k") is QUARANTINED  # the read may have started: UNKNOWN
    assert "broke the lock order" in caplog.text
    cache.check_invariants()


def test_an_error_on_an_io_thread_ends_the_publish(
    make_cache: Callable[..., EmbeddingCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runner_module.assert_unlocked

    def broken(what: str) -> None:
        if what == "store put_from":
            raise LockOrderError("store put_from while holding cache lock (injected)")
        real(what)

    monkeypatch.setattr(runner_module, "assert_unlocked", broken)
    cache = make_cache(auto_fence=None)
    with cache.request("r") as request:
        request.insert(["k"], [payload((64,), torch.float32, 4)])
        wait_until(lambda: cache.stats().publishes_unknown == 1, "the publish to end")
    assert cache.stats().pinned_entries == 0 and cache.entry_state("k") is QUARANTINED
    cache.check_invariants()


# ------------------------------------------------------------------ Request.publish
def test_publish_puts_back_what_the_store_lost(
    make_cache: Callable[..., EmbeddingCache], store: FaultInjectingStore
) -> None:
    cache = make_cache()
    tensor = payload((64,), torch.float32, 5)
    with cache.request("r") as request:
        request.insert(["k"], [tensor])
        wait_until(lambda: store.exists(["k"]) == [True], "the first publish")
    store.delete("k")
    with cache.request("again") as request:
        assert request.publish(["k"]) == [False], "not held by this request yet"
        request.lookup([item_of("k", tensor)], prefetch=False)
        assert request.publish(["k", "absent"]) == [True, False]
        wait_until(lambda: store.exists(["k"]) == [True], "the republish")
    assert store.object("k") == raw(tensor)
    assert cache.stats().publishes_ok == 2


def test_publish_refuses_a_bare_string(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache()
    with cache.request("r") as request, pytest.raises(InvalidTypeError, match="list of keys"):
        request.publish("k")


# ------------------------------------------------------------------ poison debug mode
def test_poison_overwrites_a_range_the_moment_it_is_freed(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    cache = make_cache(4096, poison_freed=True)
    tensor = payload((64,), torch.float32, 6)
    with cache.request("r") as request:
        request.insert(["k"], [tensor], publish=False)
        request.lookup([item_of("k", tensor)], prefetch=False)
        [view] = request.embeddings()
        assert view is not None and torch.equal(view, tensor)
    cache.remove("k")
    assert view.isnan().all(), "a view kept past its request must read poison once freed"
    assert bool((cache.pool[:256] == POISON).all())


def test_the_environment_turns_poison_on(
    make_cache: Callable[..., EmbeddingCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBCACHE_POISON", "1")
    cache = make_cache(4096)
    with cache.request("r") as request:
        request.insert(["k"], [payload((64,), torch.float32, 7)], publish=False)
    cache.remove("k")
    assert bool((cache.pool[:256] == POISON).all())


class Doubler(torch.nn.Module):
    """An encoder whose output for an input tensor is twice that tensor."""

    device = torch.device("cpu")

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x * 2 for x in inputs]


class ViewKeepingPipeline(EncodePipeline):
    """The bug: with one held item, keep the pool view instead of copying it."""

    def _collect(self, request, plan, statuses):  # type: ignore[no-untyped-def]
        # private: the pipeline step the bug is planted in
        local = super()._collect(request, plan, statuses)
        views = [v for v in request.embeddings() if v is not None]
        if len(views) == 1:
            return type(local)(local.statuses, local.mask, local.reasons, views[0])
        return local


def run_harsh_pipeline(
    make_cache: Callable[..., EmbeddingCache], pipeline_class: type[EncodePipeline] = EncodePipeline
) -> list[torch.Tensor]:
    """A cached item read by a pipeline whose cache poisons and evicts after every request."""
    cache = make_cache(1 << 16, poison_freed=True)
    evict_idle_after_close(cache)
    pipeline = pipeline_class(cache, Doubler())
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    item = Item("img", (2, 16), torch.float32)
    first = pipeline.encode("r1", [item], [x])  # a miss: encoded, inserted and published
    wait_until(lambda: cache.stats().pinned_entries == 0, "the publish to end")
    cache.remove("img")
    with cache.request("fill") as request:  # cached again, then read by the pipeline
        request.insert(["img"], [x * 2], publish=False)
    second = pipeline.encode("r2", [item], [x])
    assert cache.entry_state("img") is ABSENT, "the harness evicts after each request"
    return [first, second]


def test_the_pipeline_reads_cached_rows_while_it_holds_them(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    for result in run_harsh_pipeline(make_cache):
        assert torch.equal(result, x * 2)


def test_the_harness_catches_a_pipeline_that_keeps_a_view_past_its_request(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    _, second = run_harsh_pipeline(make_cache, ViewKeepingPipeline)
    assert second.isnan().any(), "the poison harness missed a read after release"


def test_a_young_small_quarantine_is_left_alone(
    make_cache: Callable[..., EmbeddingCache], store: FaultInjectingStore
) -> None:
    patient = FencePolicy(max_fraction=0.5, max_age_s=3600, min_interval_s=0.05,
                          check_interval_s=0.05)  # fmt: skip
    cache = make_cache(4096, auto_fence=patient)
    quarantine(cache, store, "q")  # 256 of 4096 bytes, far below half the pool
    time.sleep(0.5)  # ten checks of the fencer
    assert cache.entry_state("q") is QUARANTINED and cache.stats().fences == 0
