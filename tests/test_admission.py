"""Issue 15 in the cache: a policy shapes the eviction order and may refuse a BeginLoad that
would evict; a refusal evicts nothing, is traced, counted and reported as a fallback reason."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from embcache import EmbeddingCache, Item
from embcache.core.policy import make_policy
from embcache.driver.trace import TraceLog
from embcache.errors import InvalidArgumentError, InvalidTypeError
from tests.support.helpers import payload

UNIT = 256


def unit_item(key: str) -> Item:
    return Item(key, (UNIT // 4,), torch.float32)


def warm(cache: EmbeddingCache, keys: list[str], times: int) -> None:
    """Look each key up ``times`` times (hits once present)."""
    for n in range(times):
        with cache.request(f"warm-{n}") as request:
            request.lookup([unit_item(k) for k in keys], prefetch=False)


def test_tinylfu_refuses_an_insert_that_would_evict_hotter_entries(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    trace = TraceLog()
    policy = make_policy("tinylfu", min_entries=1, shift_drop=0.0)
    cache = make_cache(2 * UNIT, alignment=UNIT, policy=policy, trace=trace)
    for key in ("a", "b"):
        with cache.request(f"fill-{key}") as request:
            request.insert([key], [payload((UNIT // 4,), torch.float32, 0)], publish=False)
    warm(cache, ["a", "b"], 3)  # a and b: looked up often
    before = cache.stats()
    with cache.request("cold") as request:
        [status] = request.lookup([unit_item("cold")], prefetch=False, reserve_misses=True)
        assert status.reason is not None and status.reason.value == "not_admitted"
        assert [r.value for r in request.fallback_reasons() if r] == ["not_admitted"]
        assert request.insert(["cold"], [payload((UNIT // 4,), torch.float32, 1)]) == [False]
    after = cache.stats()
    assert after.evictions == before.evictions, "a refused BeginLoad evicted something"
    assert after.entries == 2 and after.admissions_refused == 2
    refusals = [e for e in trace.events if e["action"] == "BeginLoad" and e["outcome"] != "OK"]
    assert [(e["key"], e["outcome"]) for e in refusals] == [
        ("cold", "NOT_ADMITTED"),
        ("cold", "NOT_ADMITTED"),
    ]
    cache.check_invariants()


def test_tinylfu_admits_a_key_looked_up_more_often_than_its_victims(
    make_cache: Callable[..., EmbeddingCache],
) -> None:
    policy = make_policy("tinylfu", min_entries=1, shift_drop=0.0)
    cache = make_cache(UNIT, alignment=UNIT, policy=policy)
    with cache.request("fill") as request:
        request.insert(["a"], [payload((UNIT // 4,), torch.float32, 0)], publish=False)
    warm(cache, ["hot"], 4)  # misses, but counted
    with cache.request("hot") as request:
        [status] = request.lookup([unit_item("hot")], prefetch=False, reserve_misses=True)
        assert status.status.name == "RESERVED"
    assert cache.stats().evictions == 1 and cache.stats().admissions_refused == 0


def test_lru_never_refuses(make_cache: Callable[..., EmbeddingCache]) -> None:
    cache = make_cache(UNIT, alignment=UNIT)
    for n in range(5):
        with cache.request(f"r{n}") as request:
            tensor = payload((UNIT // 4,), torch.float32, n)
            assert request.insert([f"k{n}"], [tensor], publish=False) == [True]
    assert cache.stats().admissions_refused == 0 and cache.stats().evictions == 4


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        ("mru", InvalidArgumentError, "unknown policy 'mru'"),
        (3, InvalidTypeError, "policy must be a name"),
    ],
)
def test_a_bad_policy_is_refused(
    make_cache: Callable[..., EmbeddingCache], policy: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make_cache(UNIT, alignment=UNIT, policy=policy)
