"""The compiled core (docs/setup.md, "A compiled core"): which modules ``setup.py`` hands to
mypyc, when it builds pure Python instead (``EMBCACHE_PURE=1``, no C compiler) and that such a
build installs and runs pure, how ``embcache.core.build`` chooses at import (the run-time switch,
a source changed since the build), and, when a run says which build it tests
(``EMBCACHE_EXPECT_BUILD``, set by ``.ci/test``), that this build is the one loaded."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from embcache.core.build import MANIFEST, PURE_ENV, loaded_build

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "embcache" / "core"
SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
LOADERS = {"__init__", "build"}  # they choose which build loads, so they are Python
NOT_COMPILED = LOADERS
EXPECTED = os.environ.get("EMBCACHE_EXPECT_BUILD")
# What the subprocesses below print: the build, where a compiled module and a loader loaded
# from, and the build a cache's stats() report (torch and the driver included).
PROBE = """
import embcache.core.entry_actions as actions, embcache.core.build as build
from embcache import EmbeddingCache
print(build.loaded_build(), actions.__file__, build.__file__, EmbeddingCache(4096).stats().build)
"""


def load_setup(root: Path = ROOT) -> ModuleType:
    """``setup.py`` as a module (its ``setup()`` call runs only as a script)."""
    spec = importlib.util.spec_from_file_location("embcache_setup", root / "setup.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_name(stem: str) -> str:
    return "embcache.core" if stem == "__init__" else f"embcache.core.{stem}"


def compiled_files() -> list[Path]:
    return [p for p in CORE.iterdir() if p.name.endswith(SUFFIXES)]


def probe(path: Path, env: dict[str, str]) -> tuple[list[str], str]:
    """Run ``PROBE`` with ``path`` first on sys.path; its printed fields and its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=path, env={**env, "PYTHONPATH": str(path)},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return done.stdout.split(), done.stderr


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (PURE_ENV, "CC")}


def copy_tree(to: Path) -> Path:
    """What a build reads, copied to ``to`` (the package with any compiled modules built in
    place, which a pure build must leave out): a build there leaves this checkout alone."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "embcache", to / "embcache", ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, to / name)
    return to


def test_setup_compiles_every_module_of_the_core_but_the_loaders() -> None:
    setup = load_setup()
    assert setup.NOT_COMPILED == NOT_COMPILED
    names = {p.stem for p in setup.compiled_sources()}
    assert names == {p.stem for p in CORE.glob("*.py")} - NOT_COMPILED
    core = {"entry_actions", "request_bodies", "state", "cache_core", "eviction", "recency"}
    assert core <= names


def test_no_compiled_module_subclasses_a_builtin_container() -> None:
    """mypyc cannot compile a subclass of OrderedDict/dict/list/set (it crashed in GC): such a
    class belongs in a module left out (``NOT_COMPILED``)."""
    for path in load_setup().compiled_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).split("[")[0] for b in node.bases}
                assert not bases & {"OrderedDict", "dict", "list", "set", "Counter"}, (
                    f"{path.name}: class {node.name} subclasses {bases}"
                )
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "dataclass":
                slots = [k for k in node.keywords if k.arg == "slots"]
                assert not slots, f"{path.name}: dataclass(slots=...) (write __slots__ out)"


def test_the_build_is_pure_when_forced_or_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    setup = load_setup()
    for name in (PURE_ENV, "CC"):
        monkeypatch.delenv(name, raising=False)
    if EXPECTED == "compiled":  # CI's machine has gcc and Python.h: .ci/install saw to it
        assert setup.why_pure() is None
    monkeypatch.setenv(PURE_ENV, "1")
    assert setup.why_pure() == f"{PURE_ENV}=1"
    monkeypatch.delenv(PURE_ENV)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert setup.why_pure() == "no C compiler (/nonexistent/cc not found)"
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc on it: sysconfig's CC is gcc here
    reason = setup.why_pure()
    assert reason is not None and reason.startswith("no C compiler ("), reason


def test_a_pure_editable_build_removes_the_compiled_modules_from_the_tree(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An editable install builds the extension modules in place; a pure one after it must
    remove them (and their digests), or they would go on loading. A wheel leaves the tree."""
    core = tmp_path / "embcache" / "core"
    core.mkdir(parents=True)
    shutil.copy2(ROOT / "setup.py", tmp_path / "setup.py")
    compiled = [
        core / f"entry_actions{SUFFIXES[0]}", tmp_path / "embcache" / f"core__mypyc{SUFFIXES[0]}"
    ]
    for path in [*compiled, core / MANIFEST]:
        path.write_text("")
    setup = load_setup(tmp_path)
    monkeypatch.setenv(PURE_ENV, "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["setup.py", "bdist_wheel"])
    assert setup.extensions() == [] and all(p.exists() for p in compiled)
    monkeypatch.setattr(sys, "argv", ["setup.py", "editable_wheel", "--dist-dir", "x"])
    assert setup.extensions() == []
    left = [p for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert [p.name for p in left] == ["setup.py"]  # (setup.py's own bytecode aside)


@pytest.mark.parametrize(
    "env", [{PURE_ENV: "1"}, {"CC": "/nonexistent/cc"}], ids=["forced", "no-compiler"]
)
def test_a_pure_build_makes_a_pure_wheel_that_runs_pure(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The build backend (setuptools with setup.py, as pip calls it) in a copy of this tree:
    one line says why the build is pure, the wheel holds no extension module and no digests
    (not even when an editable build left them in the tree), and installed alone it runs the
    pure core, which ``stats()`` reports."""
    tree = copy_tree(tmp_path / "tree")
    (tmp_path / "dist").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
         "print(b.build_wheel(sys.argv[1]))", str(tmp_path / "dist")],
        cwd=tree, env={**clean_env(), **env}, capture_output=True, text=True, timeout=300,
        check=True,
    )  # fmt: skip
    said = [line for line in done.stderr.splitlines() if line.startswith("embcache:")]
    reason = f"{PURE_ENV}=1" if PURE_ENV in env else "no C compiler (/nonexistent/cc not found)"
    assert said == [f"embcache: building pure Python: {reason}"], done.stderr[-2000:]
    wheel = tmp_path / "dist" / done.stdout.split()[-1]
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    assert "embcache/core/entry_actions.py" in names and "embcache/core/build.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd", MANIFEST))], names
    (build, actions, _, stats), stderr = probe(tmp_path / "site", clean_env())
    assert (build, stats) == ("pure", "pure")
    assert Path(actions).is_relative_to(tmp_path / "site") and actions.endswith(".py"), actions
    assert "Warning" not in stderr, stderr


@pytest.mark.skipif(
    not compiled_files(),
    reason="needs a compiled build beside the sources (.ci/install makes one; this is a pure one)",
)
def test_the_compiled_core_runs_unless_switched_off_or_older_than_a_source(
    tmp_path: Path,
) -> None:
    """In a copy of the package with its compiled modules: compiled as built; pure with
    ``EMBCACHE_PURE=1`` at run time; pure, after one warning naming the file, once a compiled
    module's source changed; the loaders always from their sources."""
    copy_tree(tmp_path)
    copy = tmp_path / "embcache" / "core"
    (build, actions, loader, stats), stderr = probe(tmp_path, clean_env())
    assert (build, stats) == ("compiled", "compiled"), stderr
    assert actions.endswith(SUFFIXES) and loader == str(copy / "build.py")
    assert "Warning" not in stderr, stderr

    (build, actions, _, stats), stderr = probe(tmp_path, {**clean_env(), PURE_ENV: "1"})
    assert (build, stats, actions) == ("pure", "pure", str(copy / "entry_actions.py"))
    assert "Warning" not in stderr, stderr

    with (copy / "eviction.py").open("a") as source:
        source.write("# an edit after the build\n")
    (build, actions, _, stats), stderr = probe(tmp_path, clean_env())
    assert (build, stats, actions) == ("pure", "pure", str(copy / "entry_actions.py"))
    warned = [line for line in stderr.splitlines() if "Warning" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "RuntimeWarning: embcache: the compiled core is older than embcache/core/eviction.py; "
        "running the pure core (rebuild: pip install -e ., or bash .ci/install)"
    ), stderr


@pytest.mark.skipif(EXPECTED is None, reason="a run that says which build it tests sets it")
def test_the_build_under_test_is_the_one_loaded() -> None:
    """``.ci/test`` says which build each step tests (EMBCACHE_EXPECT_BUILD): compiled after
    ``.ci/install``, pure in the pure step. A developer's run may be either, so it skips."""
    assert EXPECTED in ("compiled", "pure")
    assert loaded_build() == EXPECTED
    for path in CORE.glob("*.py"):
        module = importlib.import_module(module_name(path.stem))
        compiled = path.stem not in NOT_COMPILED and EXPECTED == "compiled"
        file = str(module.__file__)
        # mypyc derives __file__ from the shared library's place (embcache/core/compiled__mypyc),
        # so it names a path that does not exist: the suffix says what loaded
        assert file.endswith(SUFFIXES if compiled else ".py"), f"{module.__name__}: {file}"
        assert Path(file).is_relative_to(ROOT), f"not this tree: {file}"
    if EXPECTED == "compiled":
        assert {p.name.split(".")[0] for p in compiled_files()} == {
            p.stem for p in CORE.glob("*.py")
        } - NOT_COMPILED | {"compiled__mypyc"}  # the library the compiled modules share


def test_the_compiled_core_is_not_tracked_by_git() -> None:
    outputs = [
        "embcache/core/entry_actions.cpython-311-x86_64-linux-gnu.so",
        "embcache/core/compiled__mypyc.cpython-311-x86_64-linux-gnu.so",
        f"embcache/core/{MANIFEST}",
        "build/temp.linux-x86_64-cpython-311/build/embcache/core/entry_actions.o",
    ]
    done = subprocess.run(
        ["git", "check-ignore", *outputs], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    if done.returncode == 128:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == outputs
