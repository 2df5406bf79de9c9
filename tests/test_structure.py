"""The package's shape, read from its source (embcache/DESIGN.md, "One funnel per step", "One
owner, few steps"): one owner of the state, a small core surface, a public step runner held by
composition, named flags, a short walk.

- ``CacheCore`` has at most ``MAX_CORE_MEMBERS`` public members (its steps and ``queries``).
- No module of ``embcache/`` reads a private field of another object of ours (``x._f``, ``x``
  not ``self`` or ``cls``, ``_f`` a private name the package defines): each object owns its
  state, and the driver and every ``Request`` use only the step runner's public names.
- The state is one object (``CoreState``, ``core/state.py``) built by composition: no class of
  the core inherits a class of the core that holds state, the actions are functions that
  receive the state, and ``CacheCore`` holds it.
- A ``RequestState`` is changed only by the core's actions (``core/entry_actions.py``,
  ``core/request_bodies.py``), through the transitions DESIGN lists ("Request bookkeeping").
- ``Request`` holds no method that only forwards to another object's method.
- The funnel (``StepRunner.run``) is typed with a ``ParamSpec``, so mypy checks every step's
  arguments, keywords included: a wrong one is an error.
- Every flag of a step is keyword-only, and no step call anywhere passes a bare ``True``,
  ``False`` or ``None`` by position.
- A request walks few modules: traced with ``sys.settrace`` on the pure build, an all-hit
  request (open, lookup, views, close) runs code of at most ``MAX_HIT_MODULES`` modules of
  ``embcache/``, one with a miss (lookup, insert, close) at most ``MAX_MISS_MODULES``, and
  each enters ``driver/cache.py`` at most once per step.

Each check is shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.test_layers import library_private_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embcache"
MAX_CORE_MEMBERS = 15
MAX_HIT_MODULES = 9
MAX_MISS_MODULES = 12
# The actions' modules, and entries.py, whose RequestState.copy builds a new record.
OWNERS = {"core/entry_actions.py", "core/request_bodies.py", "core/entries.py"}
REQUEST_FIELDS = {"holds", "waits", "reserved", "filling", "fallbacks", "lookup_pending"}
MUTATORS = {"add", "discard", "update", "clear", "extend", "append", "pop", "remove",
            "setdefault", "insert", "popitem", "difference_update", "intersection_update",
            "symmetric_difference_update", "sort", "reverse"}  # fmt: skip


ACTION_MODULES = ("core/entry_actions.py", "core/request_bodies.py", "core/publishing.py")


def class_def(source: str, name: str) -> ast.ClassDef:
    return next(
        node for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.name == name
    )  # fmt: skip


# ---------------------------------------------------------------------------- the core's surface
def public_members(source: str, name: str) -> list[str]:
    """The public names class ``name`` defines in ``source``: methods, properties and class
    attributes not starting with ``_``."""
    names: list[str] = []
    for node in class_def(source, name).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return sorted({n for n in names if not n.startswith("_")})


def test_the_core_has_a_small_surface() -> None:
    from embcache.core.cache_core import CacheCore

    members = public_members((PACKAGE / "core/cache_core.py").read_text(), "CacheCore")
    assert len(members) <= MAX_CORE_MEMBERS, members
    assert members == sorted(n for n in dir(CacheCore) if not n.startswith("_"))  # nothing else
    assert "queries" in members


def test_a_planted_sixteenth_core_member_is_found() -> None:
    steps = "".join(f"    def step{i}(self) -> None: ...\n" for i in range(16))
    source = f"class CacheCore:\n{steps}    def _helper(self) -> None: ...\n"
    assert len(public_members(source, "CacheCore")) == 16 > MAX_CORE_MEMBERS


# ---------------------------------------------------------------------------- one owner
def foreign_private_reads(source: str, ours: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, expression) of each use of a private field of an object not ``self``/``cls``;
    with ``ours``, only of the private names in it (the package's own, not a library's)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") or (ours is not None and node.attr not in ours):
                continue
            owner = node.value
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue  # its own method, found up the MRO
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reads_another_objects_private_fields() -> None:
    """Over the whole package: the driver reaches the core, and a ``Request`` its cache, only
    through public names (the step runner's ``run``, ``core``, ``store``, ``views``...)."""
    ours = library_private_names()
    found = {
        p.relative_to(PACKAGE).as_posix(): reads
        for p in sorted(PACKAGE.rglob("*.py"))
        if (reads := foreign_private_reads(p.read_text(), ours))
    }
    assert not found, found
    assert "_state" in ours and "_runner" in ours  # the scan knows the package's own names
    assert foreign_private_reads("x = super()._get_help_string(a)\n", ours) == []


def test_a_planted_private_read_in_the_driver_is_found() -> None:
    source = (
        "class Request:\n"
        "    def lookup(self, items):\n"
        "        return self._cache._run(self._cache._core.begin_lookup, items)\n"
    )
    ours = {"_cache", "_run", "_core"}
    assert [e for _, e in foreign_private_reads(source, ours)] == [
        "self._cache._run", "self._cache._core",
    ]  # fmt: skip


def test_a_planted_copy_of_private_fields_is_found() -> None:
    source = (
        "class CacheCore:\n"
        "    def __init__(self, actions):\n"
        "        self._actions = actions\n"
        "        self._entries = actions._entries\n"  # the shape issue 38 found
        "        self._requests = self._actions._requests\n"
    )
    assert foreign_private_reads(source) == [
        (4, "actions._entries"), (5, "self._actions._requests"),
    ]  # fmt: skip


def request_state_changes(source: str) -> list[tuple[int, str]]:
    """(line, statement) of each change of a request's bookkeeping: an assignment to, or a
    mutating call on, a ``RequestState`` field (by its name) of an object not ``self``."""
    found: list[tuple[int, str]] = []

    def field_of(node: ast.expr) -> ast.Attribute | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in REQUEST_FIELDS:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                return node
        return None

    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS:
                targets = [node.func.value]
        if any(field_of(t) for target in targets for t in ast.walk(target)):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


OWNER_MODULES = ("core/state.py", "core/cache_core.py", "core/queries.py", *ACTION_MODULES)


def stateful_subclasses(folder: Path, names: Iterable[str]) -> list[str]:
    """``"file: Class(Base)"`` for each class in the files ``names`` of ``folder`` whose base
    is a class of theirs that sets fields of its own in ``__init__`` (state inherited down a
    chain; the policies, which hold no cache state, are not among them)."""
    trees = {n: ast.parse((folder / n).read_text()) for n in names}
    stateful = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                init = [f for f in node.body if isinstance(f, ast.FunctionDef)
                        and f.name == "__init__"]  # fmt: skip
                if any(isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
                       for f in init for a in ast.walk(f) if isinstance(a, ast.Assign)
                       for t in a.targets):  # fmt: skip
                    stateful.add(node.name)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                found += [f"{name}: {node.name}({b})" for b in bases if b in stateful]
    return found


def test_the_state_is_one_object_built_by_composition() -> None:
    """``CoreState`` in ``core/state.py`` holds the state; no class of the core inherits a
    class the core defines with state of its own (``Actions`` -> ``RequestActions`` before);
    the actions' modules define functions that receive the state, and no class."""
    assert stateful_subclasses(PACKAGE, OWNER_MODULES) == []
    for module in ACTION_MODULES:
        tree = ast.parse((PACKAGE / module).read_text())
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert functions, module
        for function in functions:
            first = function.args.args[0] if function.args.args else None
            if first is not None and first.arg == "st":
                assert ast.unparse(first.annotation or ast.Constant(None)) == "CoreState"
        classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        assert all(name.startswith("_") for name in classes), (module, classes)  # records only
    assert class_def((PACKAGE / "core/state.py").read_text(), "CoreState").bases == []
    assert class_def((PACKAGE / "core/cache_core.py").read_text(), "CacheCore").bases == []


def test_a_planted_base_class_chain_is_found(tmp_path: Path) -> None:
    (tmp_path / "actions.py").write_text(
        "class Actions:\n    def __init__(self):\n        self._entries = {}\n"
    )
    (tmp_path / "request_actions.py").write_text(
        "from embcache.core.actions import Actions\nclass RequestActions(Actions): ...\n"
    )
    found = stateful_subclasses(tmp_path, ["actions.py", "request_actions.py"])
    assert found == ["request_actions.py: RequestActions(Actions)"]


def test_only_the_state_owner_changes_a_request() -> None:
    found = {
        rel: changes
        for p in sorted(PACKAGE.rglob("*.py"))
        if (rel := p.relative_to(PACKAGE).as_posix()) not in OWNERS
        if (changes := request_state_changes(p.read_text()))
    }
    assert not found, found
    owned = request_state_changes((PACKAGE / "core/request_bodies.py").read_text())
    assert owned, "the scan finds the owner's own transitions"


def test_a_planted_request_change_outside_the_owner_is_found() -> None:
    source = (
        "def step(self, rs, key):\n"
        "    rs.fallbacks[key] = None\n"
        "    rs.reserved.discard(key)\n"
        "    rs.lookup_pending = None\n"
        "    self.waits.add(key)\n"  # its own field: not a RequestState's
        "    rs.holds.get(key)\n"  # a read
    )
    assert [line for line, _ in request_state_changes(source)] == [2, 3, 4]


# ---------------------------------------------------------------------------- Request's bodies
def forwarders(source: str, name: str) -> list[str]:
    """The methods of class ``name`` whose body (docstring aside) is one call of a method of
    another object (``self._x.m(...)``, ``self._x._y.m(...)``) given only the method's own
    parameters and ``self``'s fields, unchanged: a forwarder."""
    found = []
    for node in class_def(source, name).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = list(node.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
            continue
        call = body[0].value
        if isinstance(call, ast.Await):
            call = call.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        receiver = call.func.value
        if not (
            isinstance(receiver, ast.Attribute)
            and receiver.attr.startswith("_")
            and ast.unparse(receiver).startswith("self.")
        ):
            continue
        params = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]} - {"self"}
        passed = [*call.args, *(k.value for k in call.keywords)]
        if all(
            (isinstance(a, ast.Name) and a.id in params)
            or (isinstance(a, ast.Attribute) and ast.unparse(a).startswith("self."))
            for a in passed
        ):
            found.append(node.name)
    return found


def test_request_holds_its_bodies() -> None:
    source = (PACKAGE / "driver/request.py").read_text()
    assert forwarders(source, "Request") == []
    assert "RequestDriver" not in source and not (PACKAGE / "driver/fills.py").exists()


def test_a_planted_forwarder_is_found() -> None:
    source = (
        "class Request:\n"
        "    def lookup(self, items, prefetch):\n"
        '        """Look up."""\n'
        "        return self._cache._lookup_items(self._state, items, prefetch)\n"
        "    async def wait_async(self, timeout):\n"
        "        return await self._cache._wait_async(self._state, timeout)\n"
        "    def close(self):\n"
        "        self._cache._close_request(self._state)\n"
        "    def offsets(self):\n"  # a body of its own: not a forwarder
        "        return [r[0] for r in self._now().ranges]\n"
        "    def wait(self, timeout):\n"  # checks what it is given first
        "        return self._cache._wait(self._state, _check_timeout(timeout))\n"
    )
    assert forwarders(source, "Request") == ["lookup", "wait_async", "close"]


# ---------------------------------------------------------------------------- the typed funnel
def funnel_typed(source: str, cls: str) -> bool:
    """Whether ``cls.run`` in ``source`` types its step's arguments with a ``ParamSpec``:
    ``(self, step: Callable[P, Effects[T]], /, *args: P.args, **kwargs: P.kwargs) -> T``."""
    run = next(
        node for node in class_def(source, cls).body
        if isinstance(node, ast.FunctionDef) and node.name == "run"
    )  # fmt: skip
    args = run.args

    def said(node: ast.expr | None) -> str:
        return ast.unparse(node or ast.Constant(None))

    step = [*args.posonlyargs, *args.args][1:]
    if len(step) != 1 or args.vararg is None or args.kwarg is None or said(run.returns) != "T":
        return False
    return (
        said(step[0].annotation) == "Callable[P, Effects[T]]"
        and said(args.vararg.annotation) == "P.args"
        and said(args.kwarg.annotation) == "P.kwargs"
    )


def test_the_funnel_is_a_public_typed_runner() -> None:
    source = (PACKAGE / "driver/runner.py").read_text()
    assert funnel_typed(source, "StepRunner")
    assert "run" in public_members(source, "StepRunner")


@pytest.mark.parametrize(
    "signature",
    [
        "(self, step: Callable[..., Effects[T]], *args: Any) -> T",
        "(self, step: Callable[[*Ts], Effects[T]], /, *args: *Ts) -> T",
        "(self, step: Callable[P, Effects[T]], /, *args: P.args, **kwargs: Any) -> T",
        "(self, step: Callable[P, Effects[T]], /, *args: P.args, **kwargs: P.kwargs) -> Any",
    ],
)
def test_a_planted_untyped_funnel_is_found(signature: str) -> None:
    source = f"class StepRunner:\n    def run{signature}: ...\n"
    assert not funnel_typed(source, "StepRunner")


def test_mypy_rejects_a_step_given_the_wrong_arguments(tmp_path: Path) -> None:
    """What the typing buys: a step run with an argument of the wrong type, one too many, a
    flag given by position, a keyword of the wrong type or a bare flag where a parameter
    object goes fails mypy; the right ones pass."""
    wrong = tmp_path / "wrong_step.py"
    wrong.write_text(
        "from embcache import EmbeddingCache\n"
        "cache = EmbeddingCache(1 << 16)\n"
        "runner = cache.runner\n"
        "runner.run(runner.core.remove, key=None)\n"  # right
        "runner.run(runner.core.end_request, 'r1')\n"  # a str for a RequestState
        "runner.run(runner.core.open_request, 'r1', 'extra')\n"  # one argument too many
        "runner.run(runner.core.publish, [], None, True)\n"  # flags by position
        "runner.run(runner.core.publish, [], request=None, store='yes')\n"  # a str for a bool
        "runner.run(runner.core.publish, [], request=None, store=True)\n"  # right
        "runner.run(runner.core.begin_lookup, 'r2', [], True)\n"  # a bool for the flags
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", str(wrong)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert sorted({int(line.split(":")[1]) for line in errors}) == [5, 6, 7, 8, 10], done.stdout


# ---------------------------------------------------------------------------- named flags
def positional_flags(source: str, cls: str) -> list[str]:
    """``method.parameter`` of each public method of ``cls`` whose parameter is annotated
    ``bool`` (alone or with None) and may be given by position."""
    found = []
    for node in class_def(source, cls).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            for arg in [*node.args.posonlyargs, *node.args.args]:
                if ast.unparse(arg.annotation or ast.Constant(None)) in ("bool", "bool | None"):
                    found.append(f"{node.name}.{arg.arg}")
    return found


def bare_flag_step_calls(source: str, steps: set[str]) -> list[tuple[int, str]]:
    """(line, call) of each call of a core step (``x.run(x.core.step, ...)`` or
    ``core.step(...)``) that passes ``True``, ``False`` or ``None`` by position."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        args = node.args
        if node.func.attr == "run" and args and isinstance(args[0], ast.Attribute):
            if args[0].attr not in steps:
                continue
            args = args[1:]
        elif node.func.attr not in steps or not ast.unparse(node.func.value).endswith("core"):
            continue
        if any(isinstance(a, ast.Constant) and a.value in (True, False, None) for a in args):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_every_flag_of_a_step_is_named() -> None:
    source = (PACKAGE / "core/cache_core.py").read_text()
    assert positional_flags(source, "CacheCore") == []
    steps = set(public_members(source, "CacheCore")) - {"queries"}
    found = {
        p.relative_to(ROOT).as_posix(): calls
        for folder in (PACKAGE, ROOT / "tests", ROOT / "benchmarks")
        for p in sorted(folder.rglob("*.py"))
        if (calls := bare_flag_step_calls(p.read_text(), steps))
    }
    assert not found, found


def test_planted_positional_flags_are_found() -> None:
    source = (
        "class CacheCore:\n"
        "    def end_inserts(self, rs, fills, count: int, publish: bool, *, close: bool): ...\n"
        "    def publish(self, rs: RS | None, keys, store: bool | None = None): ...\n"
    )
    assert positional_flags(source, "CacheCore") == ["end_inserts.publish", "publish.store"]
    calls = (
        "runner.run(runner.core.end_inserts, rs, fills, outcomes, 2, True, False)\n"
        "runner.run(runner.core.remove, key=None)\n"  # named: fine
        "self._core.publish(None, keys, True)\n"
        "cache.run(print, None)\n"  # not a step
    )
    assert [line for line, _ in bare_flag_step_calls(calls, {"end_inserts", "publish"})] == [1, 3]


# ---------------------------------------------------------------------------- a short walk
WALK = """
import json, os, sys, torch
from embcache import EmbeddingCache, Item
import embcache
root = os.path.dirname(embcache.__file__)
cache = EmbeddingCache(1 << 20, pin_memory=False, auto_fence=None, policy="lru")
tensor = torch.ones(16, 16)
cache.insert(["a"], [tensor])
hit, miss = [Item.of("a", tensor)], [Item.of("b", tensor)]

def walk(request):
    calls = []
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls.append(os.path.relpath(frame.f_code.co_filename, root))
    sys.settrace(tracer)
    try:
        request()
    finally:
        sys.settrace(None)
    return calls

def all_hits():
    request, _ = cache.lookup("hit", hit)
    request.embeddings()
    request.close()

def with_a_miss():
    request, _ = cache.lookup("miss", miss, reserve_misses=True)
    request.insert(["b"], [tensor])
    request.embeddings()
    request.close()

print(json.dumps({"hit": walk(all_hits), "miss": walk(with_a_miss)}))
"""


def modules_and_entries(calls: list[str], module: str) -> tuple[int, int]:
    """How many distinct modules ``calls`` (the module of each Python call, in order) ran, and
    how many times the walk entered ``module`` from another one."""
    entries = sum(
        1 for i, m in enumerate(calls) if m == module and (i == 0 or calls[i - 1] != module)
    )
    return len(set(calls)), entries


def test_a_request_walks_few_modules() -> None:
    """Traced on the pure build with lock checking off (production's configuration), items
    built before, under ``lru``: the walk of the cache itself (a frequency policy adds its own
    modules, ``record`` and ``admit``, whose cost the policy table measures: docs/benchmarks.md,
    "The default policy"). docs/architecture.md, "The walk of a request", draws both walks."""
    env = {**os.environ, "EMBCACHE_PURE": "1", "EMBCACHE_LOCK_CHECK": "0"}
    env.pop("EMBCACHE_EXPECT_BUILD", None)
    done = subprocess.run(
        [sys.executable, "-c", WALK], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    walks = json.loads(done.stdout.strip().splitlines()[-1])
    hit_modules, hit_entries = modules_and_entries(walks["hit"], "driver/cache.py")
    miss_modules, miss_entries = modules_and_entries(walks["miss"], "driver/cache.py")
    assert hit_modules <= MAX_HIT_MODULES, sorted(set(walks["hit"]))
    assert miss_modules <= MAX_MISS_MODULES, sorted(set(walks["miss"]))
    assert hit_entries == miss_entries == 1, (walks["hit"], walks["miss"])  # its first call


def test_a_planted_long_walk_is_counted() -> None:
    calls = ["driver/cache.py", "driver/request.py", "driver/cache.py", "core/cache_core.py",
             "driver/cache.py", "driver/cache.py"]  # fmt: skip
    assert modules_and_entries(calls, "driver/cache.py") == (3, 3)


@pytest.mark.parametrize(
    "module", ["core/cache_core.py", "core/state.py", "driver/request.py", "driver/runner.py"]
)
def test_the_scanned_modules_exist(module: str) -> None:
    assert (PACKAGE / module).exists()
