"""The compiled core (docs/setup.md, "A compiled core"): which modules ``.ci/compile`` hands to
mypyc, that they can be compiled, and, when a run says it tests that build
(``EMBCACHE_EXPECT_COMPILED=1``, set by ``.ci/compiled``), that every one of them is loaded from
its extension module, not its source."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.compiled import core_is_compiled

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "embcache" / "core"
NOT_COMPILED = {"recency"}  # its OrderedDict subclasses: mypyc's crashed in the garbage collector


def compiled_sources() -> list[Path]:
    """The sources ``.ci/compile`` compiles: every module of ``embcache/core`` but recency."""
    return sorted(path for path in CORE.glob("*.py") if path.stem not in NOT_COMPILED)


def module_name(source: Path) -> str:
    return "embcache.core" if source.stem == "__init__" else f"embcache.core.{source.stem}"


def test_the_compile_script_leaves_out_exactly_recency() -> None:
    script = (ROOT / ".ci" / "compile").read_text()
    assert '[ "$path" = embcache/core/recency.py ] || sources+=("$path")' in script
    assert 'for path in embcache/core/*.py; do' in script
    names = [module_name(source) for source in compiled_sources()]
    assert "embcache.core" in names and "embcache.core.actions" in names
    assert "embcache.core.recency" not in names


def test_the_compiled_core_is_not_tracked_by_git() -> None:
    outputs = [
        "embcache/core/actions.cpython-311-x86_64-linux-gnu.so",
        "embcache/core__mypyc.cpython-311-x86_64-linux-gnu.so",
        "build/mypyc/setup.py",
    ]
    done = subprocess.run(
        ["git", "check-ignore", *outputs], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    if done.returncode == 128:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == outputs


def test_no_compiled_module_subclasses_a_builtin_container() -> None:
    """mypyc cannot compile a subclass of OrderedDict/dict/list/set (it crashed in GC): such a
    class belongs in a module left out (``NOT_COMPILED``)."""
    for path in compiled_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).split("[")[0] for b in node.bases}
                assert not bases & {"OrderedDict", "dict", "list", "set", "Counter"}, (
                    f"{path.name}: class {node.name} subclasses {bases}"
                )
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "dataclass":
                slots = [k for k in node.keywords if k.arg == "slots"]
                assert not slots, f"{path.name}: dataclass(slots=...) (write __slots__ out)"


@pytest.mark.skipif(
    os.environ.get("EMBCACHE_EXPECT_COMPILED") != "1", reason="not a run of the compiled core"
)
def test_every_compiled_module_is_loaded_from_its_extension() -> None:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for source in compiled_sources():
        name = module_name(source)
        module = importlib.import_module(name)
        # mypyc derives __file__ from the shared library's place (embcache/core__mypyc...), so it
        # names embcache/embcache/core/...: the suffix says what loaded, the file beside the source
        assert str(module.__file__).endswith(suffixes), f"{name} is {module.__file__}"
        assert Path(str(module.__file__)).is_relative_to(ROOT), f"not this tree: {module.__file__}"
        assert [p for p in CORE.glob(f"{source.stem}.*") if p.name.endswith(suffixes)], name
    recency = importlib.import_module("embcache.core.recency")
    assert str(recency.__file__).endswith(".py")
    assert core_is_compiled()
