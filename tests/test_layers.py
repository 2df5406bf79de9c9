"""The package's layers, read from its imports: each module imports only from its own package
and from the layers below it, and the top of ``embcache/`` holds only packages and the public
entry points.

The layers, bottom up:

1. ``embcache.errors``: the exceptions, imported by every layer.
2. ``embcache.core``: the pure state machine (no lock, thread, clock, torch or store).
3. ``embcache.driver``: ``EmbeddingCache`` and ``Request`` around the core: the lock and its
   hierarchy checker (``locks``), the pool, the I/O threads, wake-ups, fences, poison, traces,
   and the ``GlobalStore`` protocol the driver calls (``global_store``).
4. ``embcache.store`` (stores: Mooncake), ``embcache.testing`` (the fault-injecting store) and
   ``embcache.pipeline`` (the encode pipeline, on the driver). A store sits above the driver,
   not below it: the driver owns the protocol it calls and a store implements it, so Mooncake
   may use the driver's ``assert_unlocked`` and the driver never imports a store. Packages of
   one layer do not import each other.
5. ``embcache`` (``__init__.py``): the public API.
6. ``embcache.integrations`` (one driver per serving stack) and ``embcache.tools`` (the demo,
   metrics, encoders), built on the public API.
7. ``embcache.__main__``: the command line.

Every import counts wherever it stands: at the top, inside a function, or under
``TYPE_CHECKING``. A deferred or typing-only import of a higher layer is still a dependency on
it (the module cannot be read, typed or moved without that layer), so it fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "embcache"

LAYERS: list[set[str]] = [
    {"embcache.errors"},
    {"embcache.core"},
    {"embcache.driver"},
    {"embcache.store", "embcache.testing", "embcache.pipeline"},
    {"embcache"},
    {"embcache.integrations", "embcache.tools"},
    {"embcache.__main__"},
]
TOP_LEVEL_FILES = {"__init__.py", "__main__.py", "errors.py", "testing.py", "DESIGN.md"}


def unit_of(module: str) -> str:
    """The package (or top-level module) of LAYERS that ``module`` belongs to."""
    units = {unit for layer in LAYERS for unit in layer}
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in units:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {__file__}")


def layer_of(module: str) -> int:
    unit = unit_of(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def modules_of(package: Path) -> dict[str, Path]:
    """Every module under ``package`` by its dotted name (a package by its own name)."""
    return {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(package.rglob("*.py"))
    }


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, wherever the import stands.
    ``from a import b`` imports ``a.b`` when that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for n in range(len(parts), 0, -1):  # the longest prefix that is a module
                if ".".join(parts[:n]) in known:
                    found.add(".".join(parts[:n]))
                    break
    return found


def upward_imports(package: Path) -> list[str]:
    """``a imports b`` for every import of a higher layer, or of another package of one layer."""
    modules = modules_of(package)
    bad = []
    for name, path in modules.items():
        for target in sorted(imported_modules(name, path, set(modules))):
            here, there = unit_of(name), unit_of(target)
            if here != there and layer_of(target) >= layer_of(name):
                bad.append(
                    f"{name} (layer {layer_of(name) + 1}) imports {target} "
                    f"(layer {layer_of(target) + 1})"
                )
    return bad


def stray_top_level_files(package: Path) -> list[str]:
    """Files at the top of ``package`` that are neither a package nor a public entry point."""
    return sorted(
        p.name
        for p in package.iterdir()
        if p.is_file() and p.name not in TOP_LEVEL_FILES and not p.name.startswith(".")
    )


def test_no_module_imports_a_higher_layer() -> None:
    bad = upward_imports(PACKAGE)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_top_level_holds_only_packages_and_the_entry_points() -> None:
    stray = stray_top_level_files(PACKAGE)
    assert not stray, f"embcache/ holds only packages and {sorted(TOP_LEVEL_FILES)}: move {stray}"
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert {f"embcache.{name}" for name in packages} <= {u for layer in LAYERS for u in layer}


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("core/lifecycle.py", "from embcache.driver.cache import X\n", "embcache.driver.cache"),
        ("driver/cache.py", "def f():\n    import embcache.store.mooncake\n", "embcache.store"),
        (
            "driver/cache.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from embcache import x\n",
            "embcache (layer 5)",
        ),
        ("store/mooncake.py", "from embcache.pipeline import plan\n", "embcache.pipeline.plan"),
        ("driver/cache.py", "from ..pipeline import plan\n", "embcache.pipeline.plan"),
    ],
)
def test_a_planted_upward_import_is_found(
    tmp_path: Path, module: str, source: str, expected: str
) -> None:
    package = tmp_path / "embcache"
    for name in ("__init__.py", "errors.py", "core/__init__.py", "core/lifecycle.py",
                 "driver/__init__.py", "driver/cache.py", "store/__init__.py",
                 "store/mooncake.py", "pipeline/__init__.py", "pipeline/plan.py"):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("")
    assert upward_imports(package) == []
    (package / module).write_text(source)
    (bad,) = upward_imports(package)
    assert expected in bad, bad


def test_a_stray_top_level_module_is_found(tmp_path: Path) -> None:
    package = tmp_path / "embcache"
    package.mkdir()
    for name in (*TOP_LEVEL_FILES, "pool.py"):
        (package / name).write_text("")
    assert stray_top_level_files(package) == ["pool.py"]


# ---------------------------------------------------------------- private names used by tests
ROOT = PACKAGE.parent
TESTS = ROOT / "tests"
# At most 5 (from 153, then 15): the lock-order tests use the runner's and the allocator's
# public locks, steps are counted and planted through the public ``StepRunner.run``, the
# allocator's check runs over explicit indexes (``check_blocks``), Mooncake's set-ups pause
# through ``MooncakeStore.setup_paused`` and the vLLM scheduler's store comes from
# ``store_from_options``. Left: one mutant planted in a private pipeline step.
MAX_PRIVATE_USES = 5
PRIVATE_NOTE = "# private:"
PATCHERS = {"setattr", "getattr", "hasattr", "delattr", "object", "patch"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def defined_private_names(path: Path) -> set[str]:
    """The private names ``path`` defines: ``def _x``, ``class _X``, ``_x = ...`` at module or
    class level, ``obj._x = ...`` (any object: ``self``, ``cls``, an instance) and the
    ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Name):
                    names.add(t.id)
                elif isinstance(t, ast.Attribute):
                    names.add(t.attr)
            if isinstance(target, ast.Name) and target.id == "__slots__":
                value = node.value if node.value is not None else ast.Constant(None)
                names |= {c.value for c in ast.walk(value) if isinstance(c, ast.Constant)
                          if isinstance(c.value, str)}
    return {n for n in names if is_private(n)}


def library_private_names() -> set[str]:
    """The private names the library (``embcache/``, ``models/``) defines. A test double may
    define the same name (a fake store's ``_lock``): its own uses go through ``self`` and are
    not counted, so the name still counts wherever a test reaches it on another object."""
    return {n for d in ("embcache", "models") for p in (ROOT / d).rglob("*.py")
            for n in defined_private_names(p)}


def private_uses(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """Each use in ``path`` of a name in ``names``: ``obj._x`` (``obj`` not ``self``/``cls``),
    ``from embcache... import _x``, and ``"_x"`` or ``"a.b._x"`` handed to a ``getattr``,
    ``setattr``, ``monkeypatch.setattr``, ``mock.patch`` or ``patch.object``; (line, name)."""
    uses: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                uses.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "embcache", "models"
        ):
            uses += [(node.lineno, a.name) for a in node.names if a.name in names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called not in PATCHERS:
                continue
            for arg in node.args[:2]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    last = arg.value.rsplit(".", 1)[-1]
                    if last in names:
                        uses.append((node.lineno, last))
    return sorted(set(uses))


def unjustified(path: Path, uses: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The uses whose line, or the comment just above it (one or more ``#`` lines), carries
    no ``# private: <why>``."""
    lines = path.read_text().splitlines()

    def noted(line: int) -> bool:
        if PRIVATE_NOTE in lines[line - 1]:
            return True
        above = line - 2
        while above >= 0 and lines[above].strip().startswith("#"):
            if lines[above].strip().startswith(PRIVATE_NOTE):
                return True
            above -= 1
        return False

    return [(line, name) for line, name in uses if not noted(line)]


def test_tests_use_few_private_names() -> None:
    """Tests go through public seams (the cache's ``io_executor`` and ``new_event``, its
    queries, the core's steps); a test reaches a private name of the library only to test that
    private helper itself, at most ``MAX_PRIVATE_USES`` times, each use saying why in a
    ``# private: <why>`` comment on its line or the line above."""
    names = library_private_names()
    found = {p: private_uses(p, names) for p in sorted(TESTS.rglob("*.py"))}
    found = {p: uses for p, uses in found.items() if uses}
    listing = [f"{p.relative_to(ROOT)}:{line}: {name}" for p, uses in found.items()
               for line, name in uses]
    bare = [f"{p.relative_to(ROOT)}:{line}: {name}" for p, uses in found.items()
            for line, name in unjustified(p, uses)]
    assert len(listing) <= MAX_PRIVATE_USES, (
        f"{len(listing)} uses of private names in tests (at most {MAX_PRIVATE_USES}):\n"
        + "\n".join(listing)
    )
    assert not bare, "private names used without a '# private: <why>' comment:\n" + "\n".join(bare)


def test_a_planted_private_use_is_found(tmp_path: Path) -> None:
    source = (
        "from embcache.driver.cache import _secret\n"
        "# private: the helper itself\n"
        "x = cache._core\n"
        "y = self._core\n"
        "monkeypatch.setattr(cache, '_io', None)\n"
        "patch('embcache.driver.cache._secret')\n"
        "# private: a reason\n"
        "# on two lines\n"
        "z = getattr(cache, '_io')\n"
        "# a comment that gives no reason\n"
        "w = cache._core\n"
    )
    path = tmp_path / "test_x.py"
    path.write_text(source)
    uses = private_uses(path, {"_secret", "_core", "_io"})
    assert uses == [(1, "_secret"), (3, "_core"), (5, "_io"), (6, "_secret"), (9, "_io"),
                    (11, "_core")]  # fmt: skip
    assert unjustified(path, uses) == [(1, "_secret"), (5, "_io"), (6, "_secret"),
                                       (11, "_core")]  # fmt: skip


# ---------------------------------------------------------------------------- tests and benchmarks
TESTS = Path(__file__).resolve().parent
IMPORTERS = {"import_module", "__import__", "importorskip", "run_module"}


def absolute_imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names) of every absolute import in ``path``, wherever it stands:
    ``import a.b`` is ``a.b`` with no names, ``from a import b, c`` is ``a`` with ``(b, c)``, and
    a call of ``importlib.import_module``, ``__import__``, ``pytest.importorskip`` or
    ``runpy.run_module`` with a literal module name is that name with no names."""
    return absolute_imports_in(ast.parse(path.read_text(), str(path)))


def absolute_imports_in(module: ast.Module) -> list[tuple[int, str, tuple[str, ...]]]:
    """``absolute_imports`` of a parsed module."""
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or "", tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            if called in IMPORTERS and isinstance(first, ast.Constant):
                found.append((node.lineno, str(first.value), ()))
    return found


def string_text(expr: ast.expr) -> str | None:
    """The text of a string literal; an f-string's fields read as ``_``."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "_" for v in expr.values)
    return None


def code_run(path: Path) -> list[tuple[int, str]]:
    """(line, source) of the Python code ``path`` hands to an interpreter: the argument after
    ``"-c"`` in a list or tuple (``[sys.executable, "-c", CODE]``) and the first argument of
    ``exec``, ``eval`` or ``compile``; a name there stands for every string literal assigned
    to that name in ``path``."""
    module = ast.parse(path.read_text(), str(path))
    assigned: dict[str, list[str]] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            text = string_text(node.value)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and text is not None:
                    assigned.setdefault(target.id, []).append(text)

    def texts(expr: ast.expr) -> list[str]:
        if isinstance(expr, ast.Name):
            return assigned.get(expr.id, [])
        text = string_text(expr)
        return [] if text is None else [text]

    found: list[tuple[int, str]] = []
    for node in ast.walk(module):
        if isinstance(node, ast.List | ast.Tuple):
            for flag, arg in zip(node.elts, node.elts[1:], strict=False):
                if isinstance(flag, ast.Constant) and flag.value == "-c":
                    found += [(arg.lineno, text) for text in texts(arg)]
        elif isinstance(node, ast.Call) and node.args:
            if getattr(node.func, "id", None) in {"exec", "eval", "compile"}:
                found += [(node.lineno, text) for text in texts(node.args[0])]
    return found


def benchmark_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the ``benchmarks`` package in ``path``: ``import``,
    ``from ... import``, and a call of ``importlib.import_module``, ``__import__``,
    ``pytest.importorskip`` or ``runpy.run_module`` with a literal module name; in ``path``
    itself or in the code it runs (``code_run``: ``python -c CODE``, ``exec``), at the line
    that runs it."""
    found = [
        (line, module)
        for line, module, _ in absolute_imports(path)
        if module.split(".")[0] == "benchmarks"
    ]
    for line, source in code_run(path):
        try:
            imports = absolute_imports_in(ast.parse(source))
        except SyntaxError:
            continue
        found += [(line, m) for _, m, _ in imports if m.split(".")[0] == "benchmarks"]
    return sorted(found)


def test_no_test_imports_the_benchmarks() -> None:
    """Tests run a benchmark as ``python -m benchmarks...`` in a child process; what tests and
    benchmarks share lives in ``tests/support`` (benchmarks import it, never the reverse). Code
    a test runs (``python -c CODE``, ``exec``) imports no benchmark either: a check that must
    reach into a benchmark lives beside it (``benchmarks/**/test_*.py``, run in a child by
    ``tests/test_benchmarks.py``)."""
    found = [
        f"{path.relative_to(TESTS.parent)}:{line}: {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in benchmark_imports(path)
    ]
    assert not found, "tests importing the benchmarks:\n" + "\n".join(found)


def test_a_planted_benchmark_import_is_found(tmp_path: Path) -> None:
    source = (
        "import benchmarks\n"
        "from benchmarks.micro import bench_copy\n"
        "import benchmarksish, json\n"
        "def f():\n"
        "    import benchmarks.run as r\n"
        "    importlib.import_module('benchmarks.peers.bench_vllm')\n"
        "    pytest.importorskip('benchmarks.common')\n"
        "    subprocess.run([sys.executable, '-m', 'benchmarks.run'])\n"
        "    from tests.support import baselines\n"
    )
    path = tmp_path / "test_x.py"
    path.write_text(source)
    assert benchmark_imports(path) == [
        (1, "benchmarks"),
        (2, "benchmarks.micro"),
        (5, "benchmarks.run"),
        (6, "benchmarks.peers.bench_vllm"),
        (7, "benchmarks.common"),
    ]


def test_a_planted_benchmark_import_in_code_a_test_runs_is_found(tmp_path: Path) -> None:
    source = (
        'CODE = """\nimport sys\nimport benchmarks.peers.bench_sglang_adapter as bench\n"""\n'
        "def f(name):\n"
        "    subprocess.run([sys.executable, '-c', CODE, '--plant'])\n"
        "    subprocess.run((sys.executable, '-c', 'from benchmarks import common'))\n"
        "    exec(compile('import benchmarks.run', 'x', 'exec'))\n"
        "    planted = f'from benchmarks.micro import {name}'\n"
        "    subprocess.run([sys.executable, '-c', planted])\n"
        "    subprocess.run([sys.executable, '-m', 'benchmarks.run'])\n"
        "    path.write_text('import benchmarks')\n"
        "    subprocess.run([sys.executable, '-c', 'import benchmarksish; x = ('])\n"
    )
    path = tmp_path / "test_x.py"
    path.write_text(source)
    assert benchmark_imports(path) == [
        (6, "benchmarks.peers.bench_sglang_adapter"),
        (7, "benchmarks"),
        (8, "benchmarks.run"),
        (10, "benchmarks.micro"),
    ]


def imports_of_tests_outside_support(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` of a ``tests`` module outside
    ``tests.support``, in every form ``benchmark_imports`` reads; ``from tests import x`` is
    ``tests.x``."""
    found: list[tuple[int, str]] = []
    for line, module, names in absolute_imports(path):
        targets = [f"{module}.{name}" for name in names] if module == "tests" else [module]
        found += [
            (line, target)
            for target in targets
            if target.split(".")[0] == "tests" and target.split(".")[:2] != ["tests", "support"]
        ]
    return sorted(found)


def test_no_benchmark_imports_tests_outside_support() -> None:
    """Benchmarks import from ``tests`` only ``tests.support``, and ``tests/support`` imports
    from ``tests`` only itself, so a benchmark reaches no other test module through it either:
    what a benchmark needs of the tests (a workload, a replay of a peer's calls) moves into
    ``tests/support``."""
    files = sorted((TESTS.parent / "benchmarks").rglob("*.py"))
    files += sorted((TESTS / "support").rglob("*.py"))
    assert len(files) > 10, files  # the walk found the benchmarks
    found = [
        f"{path.relative_to(TESTS.parent)}:{line}: {module}"
        for path in files
        for line, module in imports_of_tests_outside_support(path)
    ]
    assert not found, "imports of tests outside tests.support:\n" + "\n".join(found)


def test_a_planted_tests_import_in_a_benchmark_is_found(tmp_path: Path) -> None:
    source = (
        "import tests.stress.workload\n"
        "from tests.sglang_controller import mmencoder\n"
        "from tests import tracegen, support\n"
        "from tests.support import baselines\n"
        "import tests.support.rows, testsish, json\n"
        "def f():\n"
        "    from tests.supportish import x\n"
        "    importlib.import_module('tests.sglang_controller.mmencoder')\n"
        "    __import__('tests.support.mixes')\n"
        "    pytest.importorskip('tests.tracegen')\n"
        "    from tests import *\n"
        "    subprocess.run([sys.executable, '-m', 'tests.tracegen'])\n"
        "    from .stress import Workload\n"
    )
    path = tmp_path / "bench_x.py"
    path.write_text(source)
    assert imports_of_tests_outside_support(path) == [
        (1, "tests.stress.workload"),
        (2, "tests.sglang_controller"),
        (3, "tests.tracegen"),
        (7, "tests.supportish"),
        (8, "tests.sglang_controller.mmencoder"),
        (10, "tests.tracegen"),
        (11, "tests.*"),
    ]
