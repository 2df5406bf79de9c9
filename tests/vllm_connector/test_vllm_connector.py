"""``EmbcacheECConnector`` against vLLM 0.33.0's real interface (``tests.support.vllm_wheel``):
signatures, pickled metadata, both roles in one process over hundreds of requests, the pin
held until every rank acked, lost acks, options and wrong-role calls.

The steps and names are embcache/DESIGN.md's "vLLM: the scheduler/worker split".
"""

from __future__ import annotations

import inspect
import pickle
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from embcache import InvalidArgumentError, InvalidTypeError
from tests.support.default_policy import chosen
from tests.support.funnel import replace_funnel
from tests.support.helpers import DEVICES
from tests.vllm_connector.vllm_replay import (
    DTYPE,
    WIDTH,
    FakeRequest,
    LocalRank,
    Replay,
    embedding,
    requests,
)

pytestmark = pytest.mark.timeout(300)
SMALL = {"pool_bytes": 48 * 1024}


def shape(fn: Any) -> list[tuple[str, inspect._ParameterKind, str]]:
    """Parameters as names, kinds and defaults (annotations are each module's own objects)."""
    return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]


def test_every_method_we_define_has_the_signature_of_vllms_base(vllm_base: Any) -> None:
    from embcache.integrations.vllm import EmbcacheECConnector

    base = vllm_base.ECConnectorBase
    theirs = dict(inspect.getmembers(base, inspect.isfunction))
    ours = {n: f for n, f in vars(EmbcacheECConnector).items() if inspect.isfunction(f)}
    shared = sorted(ours.keys() & theirs.keys())
    # has_cache_item is a slot (EmbcacheECConnector's docstring): a callable of one identifier
    # per role, which the tests below call in both roles
    assert set(base.__abstractmethods__) <= {*shared, "has_cache_item"}
    assert isinstance(vars(EmbcacheECConnector)["has_cache_item"], types.MemberDescriptorType)
    assert not EmbcacheECConnector.__abstractmethods__
    assert {"ensure_cache_available", "update_connector_output", "request_finished"} <= set(shared)
    for name in shared:
        assert shape(ours[name]) == shape(theirs[name]), name
    extra = sorted(n for n in ours.keys() - theirs.keys() if not n.startswith("_"))
    assert extra == ["check_invariants", "stats"]


def _one_step(sched: Any, request: FakeRequest) -> Any:
    assert sched.ensure_cache_available(request, 0)
    for index in range(len(request.keys)):
        sched.has_cache_item(request.keys[index])
        sched.update_state_after_alloc(request, index)
    from tests.support.vllm_wheel import SchedulerOutput

    return sched.build_connector_meta(SchedulerOutput())


def _insert(sched: Any, key: str, rows: int) -> None:
    """Put ``key`` in the scheduler's cache through a finished request of its own."""
    cache = sched.scheduler_side.cache  # seeded through the scheduler side's own cache
    with cache.request(f"seed-{key}") as r:
        r.insert([key], [embedding(key, rows)], publish=False)


def test_the_metadata_and_the_acks_survive_pickling(make_scheduler: Callable[..., Any]) -> None:
    sched = make_scheduler(SMALL)
    _insert(sched, "a", 8)
    meta = _one_step(sched, FakeRequest("r1", ["a", "b"], {"a": 8, "b": 16}, 1))
    again = pickle.loads(pickle.dumps(meta))
    assert type(again) is type(meta)
    assert (again.step, again.pool, again.loads, again.saves) == (
        meta.step,
        meta.pool,
        meta.loads,
        meta.saves,
    )
    assert [t.key for t in meta.loads] == ["a"] and [t.key for t in meta.saves] == ["b"]
    assert meta.loads[0].shape == (8, WIDTH) and meta.loads[0].dtype == DTYPE
    from embcache.integrations.vllm import EmbcacheECWorkerMetadata

    acks = EmbcacheECWorkerMetadata({0: [(0, "a")]}, {(0, "b"): True})
    merged = acks.aggregate(EmbcacheECWorkerMetadata({1: [(0, "a")]}))
    assert pickle.loads(pickle.dumps(merged)) == merged
    assert merged.loaded == {0: [(0, "a")], 1: [(0, "a")]} and acks.loaded == {0: [(0, "a")]}


@pytest.mark.parametrize("device", DEVICES)
def test_both_roles_in_one_process_hundreds_of_requests_under_eviction(
    make_scheduler: Callable[..., Any], device: str
) -> None:
    """On ``cuda`` (``bash .ci/cuda``) the ranks load into and save from GPU tensors
    (``start_load_caches``' copy to the device, ``save_caches``' copy back), each output made
    late on the current stream: every byte checked."""
    sched = make_scheduler(SMALL)
    ranks = [LocalRank("ec_both", SMALL, 2, r, device) for r in range(2)]
    replay = Replay(sched, ranks)
    for request in requests(300, 40, seed=1):
        replay.add(request)
    while replay.waiting or replay.running:
        replay.step()
        sched.check_invariants()
    assert replay.report.errors == []
    stats, cache = sched.stats(), sched.scheduler_side.cache.stats()
    assert replay.report.declared > 50 and cache.evictions > 20 and stats.inserts > 20
    assert stats.open_requests == 0 and cache.open_requests == 0
    assert cache.pinned_entries == 0 and stats.quarantined_requests == 0
    assert stats.outstanding_loads == stats.outstanding_saves == 0


def test_has_cache_item_is_true_only_for_an_item_the_request_pins(
    make_scheduler: Callable[..., Any],
) -> None:
    sched = make_scheduler(SMALL)
    _insert(sched, "a", 8)
    assert not sched.has_cache_item("a")  # READY, but no request holds it
    request = FakeRequest("r1", ["a", "b"], {"a": 8, "b": 8}, 1)
    assert sched.ensure_cache_available(request, 0)
    assert sched.has_cache_item("a") and not sched.has_cache_item("b")
    other = FakeRequest("r2", ["b"], {"b": 8}, 1)
    assert sched.ensure_cache_available(other, 0)
    assert not sched.has_cache_item("a")  # pinned, but for r1, not for the request asked about
    producer = make_scheduler(SMALL, role="ec_producer")
    _insert(producer, "a", 8)
    assert producer.ensure_cache_available(FakeRequest("p1", ["a"], {"a": 8}, 1), 0)
    assert not producer.has_cache_item("a")  # a producer's ranks never load


def test_a_pin_ends_only_when_every_rank_acked_and_the_request_finished(
    make_scheduler: Callable[..., Any],
) -> None:
    from vllm.v1.outputs import ECConnectorOutput

    from embcache.integrations.vllm import EmbcacheECWorkerMetadata

    sched = make_scheduler(SMALL)
    _insert(sched, "a", 8)
    request = FakeRequest("r1", ["a"], {"a": 8}, 1)
    meta = _one_step(sched, request)
    cache = sched.scheduler_side.cache
    load = (meta.step, "a")
    sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=EmbcacheECWorkerMetadata({0: [load]}))
    )
    sched.request_finished(request)
    assert cache.stats().pinned_entries == 1 and sched.stats().open_requests == 1
    assert cache.clear() == 1 and cache.entry_state("a").name == "READY"  # doomed, not freed
    sched.check_invariants()
    sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=EmbcacheECWorkerMetadata({1: [load]}))
    )
    assert cache.stats().pinned_entries == 0 and sched.stats().open_requests == 0
    assert cache.entry_state("a").name == "ABSENT"
    sched.check_invariants()


def test_a_lost_ack_quarantines_the_range_for_good_and_a_late_one_ends_it(
    make_scheduler: Callable[..., Any],
) -> None:
    from vllm.v1.outputs import ECConnectorOutput

    from embcache.integrations.vllm import EmbcacheECWorkerMetadata

    sched = make_scheduler({**SMALL, "hold_timeout_s": 0.01, "policy": "lru"})  # fills evict
    _insert(sched, "a", 8)
    request = FakeRequest("r1", ["a"], {"a": 8}, 1)
    meta = _one_step(sched, request)
    sched.request_finished(request)
    time.sleep(0.02)
    sched.update_connector_output(
        ECConnectorOutput(
            ec_connector_worker_meta=EmbcacheECWorkerMetadata({0: [(meta.step, "a")]})
        )
    )
    stats = sched.stats()
    assert stats.quarantined_requests == 1 and stats.quarantined_bytes == 8 * WIDTH * 2
    cache = sched.scheduler_side.cache
    for i in range(30):  # pressure: every other entry is evicted, the held one stays
        with cache.request(f"fill-{i}") as r:
            r.insert([f"f{i}"], [torch.zeros(64, WIDTH, dtype=DTYPE)], publish=False)
    assert cache.entry_state("a").name == "READY" and cache.stats().evictions > 0
    sched.check_invariants()
    late = EmbcacheECWorkerMetadata({1: [(meta.step, "a")]})
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=late))
    assert sched.stats().quarantined_requests == 0 and cache.stats().pinned_entries == 0
    sched.check_invariants()


def test_a_store_read_defers_the_request_until_it_ends(
    make_scheduler: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from embcache.integrations.vllm import scheduler
    from embcache.testing import FaultInjectingStore

    # The connector makes its store from its options (Mooncake only, made by vLLM's factory):
    # the test swaps that function for one that makes an in-process store.
    monkeypatch.setattr(scheduler, "store_from_options", lambda options: FaultInjectingStore())
    sched = make_scheduler(SMALL)
    store = sched.scheduler_side.cache.store
    assert isinstance(store, FaultInjectingStore)
    key = "stored"
    with sched.scheduler_side.cache.request("seed") as r:
        r.insert([key], [embedding(key, 8)])  # published to the store, then evicted below
    sched.scheduler_side.cache.clear()
    deadline = time.monotonic() + 10
    while not store.exists([key])[0]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    request = FakeRequest("r1", [key], {key: 8}, 1)
    while not sched.ensure_cache_available(request, 0):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert sched.has_cache_item(key)


@pytest.mark.parametrize(
    ("extra", "error", "words"),
    [
        ({"pool_bytes": 0}, InvalidArgumentError, "pool_bytes must be > 0, got 0"),
        ({"pool_bytes": "1G"}, InvalidTypeError, "pool_bytes must be an int, got '1G'"),
        ({"staging_bytes": -1}, InvalidArgumentError, "staging_bytes must be > 0, got -1"),
        ({"hold_timeout_s": 0}, InvalidArgumentError, "hold_timeout_s must be finite and > 0"),
        ({"hold_timeout_s": "5"}, InvalidTypeError, "hold_timeout_s must be seconds, got '5'"),
        ({"mooncake_master": "nohost"}, InvalidArgumentError, "mooncake_master='nohost'"),
        ({"policy": "fifo"}, InvalidArgumentError, "fifo"),
        ({"pool_size": 1}, InvalidArgumentError, "unknown ec_connector_extra_config"),
        ({"key_prefix": ""}, InvalidTypeError, "key_prefix must be a non-empty str"),
    ],
)
def test_each_option_is_checked_with_a_clear_error(
    make_scheduler: Callable[..., Any], extra: dict[str, Any], error: type, words: str
) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        make_scheduler({**SMALL, **extra})


def test_without_options_it_has_no_global_tier(make_scheduler: Callable[..., Any]) -> None:
    """No mooncake_master: no store at all (nothing outside the pool keeps payload bytes)."""
    sched = make_scheduler()
    assert sched.scheduler_side.cache.store is None
    assert sched.scheduler_side.cache.capacity == 1 << 30


def test_without_a_policy_option_it_takes_the_chosen_default(vllm_base: Any) -> None:
    """The connector's cache takes the default policy that issue 57's committed table names
    (``tests/test_default_policy.py``), as ``EmbeddingCache`` does."""
    from embcache.integrations.vllm.options import ConnectorOptions, parse_options

    assert parse_options({}).policy == ConnectorOptions().policy == chosen()


def test_a_method_of_the_other_role_raises(make_scheduler: Callable[..., Any]) -> None:
    sched = make_scheduler(SMALL)
    with pytest.raises(InvalidArgumentError, match="start_load_caches is a worker-role method"):
        sched.start_load_caches({})
    worker = LocalRank("ec_both", SMALL, 2, 0).connector
    with pytest.raises(InvalidArgumentError, match="has_cache_item is a scheduler-role method"):
        worker.has_cache_item("a")
    with pytest.raises(InvalidArgumentError, match="worker_side is a worker-role method"):
        sched.worker_side  # noqa: B018 (the property raises)
    with pytest.raises(InvalidArgumentError, match="scheduler_side is a scheduler-role method"):
        worker.scheduler_side  # noqa: B018 (the property raises)
    assert worker.worker_side is not None and sched.scheduler_side.cache is not None


def test_ensure_cache_available_is_one_funnel_call_and_has_cache_item_none(
    make_scheduler: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39's few steps per request on vLLM's scheduler side: ``ensure_cache_available``
    of a new request is one trip through the cache's funnel (``StepRunner.run``: the
    lookup that pins what is present), asked again it is none, and ``has_cache_item`` never
    is one."""
    sched = make_scheduler(SMALL)
    _insert(sched, "a", 8)
    cache = sched.scheduler_side.cache
    steps: list[str] = []

    def counting(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            steps.append(step.__name__)
            return run(step, *args, **kwargs)

        return counted

    replace_funnel(cache, counting)
    request = FakeRequest("r1", ["a", "b", "c"], {"a": 8, "b": 8, "c": 8}, 1)
    assert sched.ensure_cache_available(request, 0)
    assert len(steps) == 1, steps
    assert sched.has_cache_item("a") and not sched.has_cache_item("b")
    assert sched.ensure_cache_available(request, 8)  # the next step: known, nothing to do
    assert len(steps) == 1, steps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_item_of_matrix_is_the_item_of_its_shape(dtype: torch.dtype) -> None:
    """``Item.of_matrix`` (how the connector names a multimodal item, without re-checking
    vLLM's ints field by field) builds exactly what ``Item(key, (rows, width), dtype)`` does."""
    from embcache import Item

    made, plain = Item.of_matrix("img-1", 37, 128, dtype), Item("img-1", (37, 128), dtype)
    assert made == plain and made.nbytes == plain.nbytes == 37 * 128 * dtype.itemsize
    assert type(made.shape) is tuple and made.shape == (37, 128)
