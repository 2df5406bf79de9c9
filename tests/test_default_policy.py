"""The default policy is the one issue 57's rule chose: the policy the committed table
(``benchmarks/policy/results/default_policy.json``, written by
``benchmarks.policy.choose_default``) names is ``EmbeddingCache``'s default, the SGLang
adapter's and the vLLM connector's, and the table's choice follows its own numbers."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from embcache import EmbeddingCache
from embcache.core.policy import POLICIES
from embcache.integrations.sglang import ControllerBase
from tests.support import default_policy


@pytest.fixture(scope="module")
def table() -> dict[str, Any]:
    return default_policy.table()


def test_the_table_names_a_product_policy_measured_on_both_seeds(table: dict[str, Any]) -> None:
    assert table["default"] in POLICIES, table["default"]
    assert table["commit"] and table["date"]
    for family in ("grid", "five", "server"):
        assert len(table["seeds"][family]) == 2, table["seeds"]
        cells = [c for c in table["cells"] if c["family"] == family]
        assert cells and all(c["seeds"] == table["seeds"][family] for c in cells), family


def test_the_tables_choice_follows_the_rule(table: dict[str, Any]) -> None:
    """The highest mean among the policies never more than ``max_loss`` points below lru on a
    cell, recomputed from the cells (ties: the table's hit-path order, checked apart)."""
    loss = table["rule"]["max_loss"]
    cells = table["cells"]
    means = {}
    for name in (n for n in table["policies"] if n in POLICIES):  # variants cannot be default
        if all(c["saved"][name] - c["saved"]["lru"] >= -loss for c in cells):
            means[name] = sum(c["saved"][name] for c in cells) / len(cells)
    best = max(means.values())
    tied = [n for n in means if round(means[n], 2) == round(best, 2)]
    assert table["default"] in tied, (table["default"], means)


def test_embedding_cache_defaults_to_the_tables_policy(table: dict[str, Any]) -> None:
    default = inspect.signature(EmbeddingCache).parameters["policy"].default
    assert default == table["default"]


def test_the_sglang_adapter_defaults_to_it(table: dict[str, Any]) -> None:
    assert ControllerBase.cache_policy == table["default"]
