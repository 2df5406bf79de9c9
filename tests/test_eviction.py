"""``choose_victims`` chooses exactly the victims of the rule as DESIGN.md states it, read
literally by brute force (``models.eviction``, which shares no code with
``embcache.core.eviction``), on random and on every small layout of free blocks, candidates and
other entries, for every size asked for and every batch limit; and examines candidates only
until the first feasible run."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.core import eviction as code
from embcache.core.eviction import Window, choose_victims, free_around_by_blocks
from embcache.driver.allocator import Block, RangeAllocator
from models import eviction as reference
from tests.support.compiled import not_on_the_compiled_core

ALIGN = 256
SOURCE = Path(__file__).resolve().parents[1] / "embcache" / "core" / "eviction.py"  # of `code`


def build(sizes: list[int], kinds: str) -> tuple[RangeAllocator, list[Block]]:
    """An allocator whose blocks are ``sizes`` (in units) of ``kinds`` (F free, C candidate,
    O other allocated), and the candidates' blocks in address order."""
    allocator = RangeAllocator(sum(sizes) * ALIGN, ALIGN)
    offsets = [allocator.allocate(size * ALIGN) for size in sizes]
    candidates = []
    for kind, offset, size in zip(kinds, offsets, sizes, strict=True):
        assert offset is not None
        if kind == "F":
            allocator.free(offset)
        elif kind == "C":
            candidates.append(Block(offset, size * ALIGN, False))
    return allocator, candidates


def both(
    allocator: RangeAllocator, order: list[Block], need: int, max_batch: int
) -> tuple[Window | None, Window | None]:
    """The victims of ``choose_victims`` and of the reference; asserts that the allocator's
    one-call ``free_around`` and the two block queries give the same ones."""
    new = choose_victims(need, order, max_batch, allocator.block_before, allocator.block_at)
    generic = choose_victims(  # other callables than the allocator's methods: no free_around
        need, order, max_batch, lambda o: allocator.block_before(o), lambda o: allocator.block_at(o)
    )
    assert generic == new
    old = reference.choose_victims(need, [b.offset for b in order], max_batch, layout(allocator))
    return new, None if old is None else Window(*old)


def layout(allocator: RangeAllocator) -> list[tuple[int, int, bool]]:
    """Every block of ``allocator`` as ``(offset, size, free)``, in address order."""
    used = [(offset, size, False) for offset, size in allocator.allocations()]
    return sorted(used + [(offset, size, True) for offset, size in allocator.free_blocks()])


@settings(max_examples=400, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(1, 6), st.sampled_from("FCCO")), min_size=1, max_size=24),
    data=st.data(),
    max_batch=st.integers(1, 6),
)
def test_same_victims_as_the_reference_on_random_layouts(
    layout: list[tuple[int, str]], data: st.DataObject, max_batch: int
) -> None:
    sizes = [size for size, _ in layout]
    allocator, candidates = build(sizes, "".join(kind for _, kind in layout))
    order = data.draw(st.permutations(candidates))
    need = data.draw(st.integers(1, (sum(sizes) + 1) * ALIGN))
    new, old = both(allocator, order, need, max_batch)
    assert new == old


def small_layouts(max_len: int) -> Iterator[str]:
    """Every row of F, C, O up to ``max_len`` blocks with at least one C."""
    rows = [""]
    for _ in range(max_len):
        rows = [r + k for r in rows for k in "FCO"]
        yield from (r for r in rows if "C" in r)


def test_same_victims_as_the_reference_on_every_small_layout() -> None:
    checked = 0
    for kinds in small_layouts(5):
        sizes = [1 + (i * 2) % 3 for i in range(len(kinds))]  # 1, 3, 2, 1, 3 units
        allocator, candidates = build(sizes, kinds)
        orders = [candidates, candidates[::-1], candidates[1::2] + candidates[::2]]
        for order in orders:
            for need in range(1, sum(sizes) + 2):
                for max_batch in (1, 2, 3):
                    new, old = both(allocator, order, need * ALIGN, max_batch)
                    assert new == old, (kinds, order, need, max_batch)
                    checked += 1
    assert checked > 10_000


def test_examines_candidates_only_until_the_first_feasible_run() -> None:
    # O C F C O C C: the second candidate in order lies beside the first one's free block.
    allocator, (a, b, c, d) = build([1, 1, 1, 1, 1, 2, 2], "OCFCOCC")
    seen: list[Block] = []

    def order() -> Iterator[Block]:
        for block in (d, a, b, c):
            seen.append(block)
            yield block

    window = choose_victims(3 * ALIGN, order(), 4, allocator.block_before, allocator.block_at)
    assert window == Window((a.offset, b.offset), 2 * ALIGN, ALIGN, 3 * ALIGN)
    assert seen == [d, a, b]  # c is never looked at


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_lone_candidate_takes_its_free_neighbours(max_batch: int) -> None:
    allocator, (a, b) = build([1, 2, 1, 1, 1], "CFCFO")
    # b with the free blocks on both sides spans 4 units; a and b together 5 (two victims).
    assert choose_victims(
        4 * ALIGN, [b, a], max_batch, allocator.block_before, allocator.block_at
    ) == Window((b.offset,), ALIGN, ALIGN, 4 * ALIGN)
    five = choose_victims(5 * ALIGN, [b, a], max_batch, allocator.block_before, allocator.block_at)
    assert five == (
        Window((a.offset, b.offset), 2 * ALIGN, 0, 5 * ALIGN) if max_batch == 2 else None
    )


def test_free_around_is_the_two_block_queries() -> None:
    for kinds in small_layouts(4):
        sizes = [1 + i % 2 for i in range(len(kinds))]
        allocator, candidates = build(sizes, kinds)
        by_blocks = free_around_by_blocks(allocator.block_before, allocator.block_at)
        for block in candidates:
            span = (block.offset, block.offset + block.size)
            assert allocator.free_around(*span) == by_blocks(*span), (kinds, block)


def test_the_model_shares_no_code_with_the_code_it_checks() -> None:
    """No import of embcache at all, no function of the same name, no copied line."""
    model_source = inspect.getsource(reference)
    tree = ast.parse(model_source)
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [m for m in imported if m and m.split(".")[0] == "embcache"], imported
    code_source = SOURCE.read_text()
    defined = {
        node.name
        for node in ast.walk(ast.parse(code_source))
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }
    model_defined = {
        node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }
    assert model_defined & defined <= {"choose_victims"}, model_defined & defined

    def statements(source: str) -> set[str]:
        """Lines of code: no docstring, import or bare field declaration (the result's shape
        is the same by design)."""
        lines = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue
            if isinstance(node, ast.stmt) and not isinstance(
                node, ast.FunctionDef | ast.ClassDef | ast.Expr | ast.Import | ast.ImportFrom
            ):
                text = ast.unparse(node).splitlines()[0]
                if len(text) > 20:
                    lines.add(text)
        return lines

    shared = statements(model_source) & statements(code_source)
    assert not shared, shared


PLANTED = {  # one-line bugs in the helpers the model used to copy
    "best_window wants a span larger than asked": (
        "best_window",
        lambda real: lambda pieces, need, max_batch, must: real(pieces, need + 1, max_batch, must),
    ),
    "neighbourhood walks one candidate too few each side": (
        "neighbourhood",
        lambda real: lambda block, max_batch, *rest: real(block, max(1, max_batch - 1), *rest),
    ),
}


@not_on_the_compiled_core(
    "it plants a bug by patching embcache.core.eviction's helpers, which choose_victims calls "
    "in C; it tests the model comparison (the harness), not the product"
)
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_model_catches_a_bug_in_the_helpers(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, plant = PLANTED[bug]
    monkeypatch.setattr(code, name, plant(getattr(code, name)))
    for kinds in small_layouts(5):
        sizes = [1 + (i * 2) % 3 for i in range(len(kinds))]
        allocator, candidates = build(sizes, kinds)
        for need in range(1, sum(sizes) + 2):
            new, old = both(allocator, candidates, need * ALIGN, 3)
            if new != old:
                return
    pytest.fail(f"planted bug not caught: {bug}")
