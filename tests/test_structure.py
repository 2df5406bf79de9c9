"""The core's shape, read from its source (embcache/DESIGN.md, "One funnel per step"): one owner
of the state, a small core surface, a ``Request`` that holds its own steps, a typed funnel.

- ``CacheCore`` has at most ``MAX_CORE_MEMBERS`` public members (its steps and ``queries``).
- No class of ``embcache/core/`` reads another object's private field (``x._f``, ``x`` not
  ``self`` or ``cls``): the state has one owner, and nothing copies its fields.
- A ``RequestState`` is changed only by the core's state owner (``core/actions.py``,
  ``core/request_actions.py``), through the transitions DESIGN lists ("Request bookkeeping").
- ``Request`` holds no method that only forwards to another object's method.
- The funnel (``EmbeddingCache._run``, and ``CachePort._run`` that ``Request`` calls) is typed
  with a ``TypeVarTuple`` (or a ``ParamSpec``), so mypy checks every step's arguments: a wrong
  one is an error.

Each check is shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embcache"
MAX_CORE_MEMBERS = 15
# The state owner's modules, and entries.py, whose RequestState.copy builds a new record.
OWNERS = {"core/actions.py", "core/request_actions.py", "core/entries.py"}
REQUEST_FIELDS = {"holds", "waits", "reserved", "filling", "fallbacks", "lookup_pending"}
MUTATORS = {"add", "discard", "update", "clear", "extend", "append", "pop", "remove",
            "setdefault", "insert", "popitem", "difference_update", "intersection_update",
            "symmetric_difference_update", "sort", "reverse"}  # fmt: skip


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
def foreign_private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each read of a private field of an object not ``self``/``cls``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_core_class_reads_another_objects_private_fields() -> None:
    found = {
        p.relative_to(PACKAGE).as_posix(): reads
        for p in sorted((PACKAGE / "core").glob("*.py"))
        if (reads := foreign_private_reads(p.read_text()))
    }
    assert not found, found


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


def test_only_the_state_owner_changes_a_request() -> None:
    found = {
        rel: changes
        for p in sorted(PACKAGE.rglob("*.py"))
        if (rel := p.relative_to(PACKAGE).as_posix()) not in OWNERS
        if (changes := request_state_changes(p.read_text()))
    }
    assert not found, found
    owned = request_state_changes((PACKAGE / "core/request_actions.py").read_text())
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
    """Whether ``cls._run`` in ``source`` types its step's arguments: ``(step: Callable[[*Ts],
    Effects[T]], /, *args: *Ts) -> T`` (a ``TypeVarTuple``: positional arguments only, so a
    call builds no keyword dict) or ``(step: Callable[P, Effects[T]], /, *args: P.args,
    **kwargs: P.kwargs) -> T`` (a ``ParamSpec``)."""
    run = next(
        node for node in class_def(source, cls).body
        if isinstance(node, ast.FunctionDef) and node.name == "_run"
    )  # fmt: skip
    args = run.args

    def said(node: ast.expr | None) -> str:
        return ast.unparse(node or ast.Constant(None))

    step = [*args.posonlyargs, *args.args][1:]
    if len(step) != 1 or args.vararg is None or said(run.returns) != "T":
        return False
    typed = (said(step[0].annotation), said(args.vararg.annotation), args.kwarg)
    if typed[:2] == ("Callable[[*Ts], Effects[T]]", "*Ts"):
        return args.kwarg is None
    return typed[:2] == ("Callable[P, Effects[T]]", "P.args") and (
        args.kwarg is not None and said(args.kwarg.annotation) == "P.kwargs"
    )


def test_the_funnel_is_typed() -> None:
    assert funnel_typed((PACKAGE / "driver/cache.py").read_text(), "EmbeddingCache")
    assert funnel_typed((PACKAGE / "driver/request.py").read_text(), "CachePort")


@pytest.mark.parametrize(
    "signature",
    [
        "(self, step: Callable[..., Effects[T]], *args: Any) -> T",
        "(self, step: Callable[[*Ts], Effects[T]], /, *args: Any) -> T",
        "(self, step: Callable[[*Ts], Effects[T]], /, *args: *Ts, **kwargs: Any) -> T",
        "(self, step: Callable[P, Effects[T]], /, *args: P.args, **kwargs: Any) -> T",
        "(self, step: Callable[[*Ts], Effects[T]], /, *args: *Ts) -> Any",
    ],
)
def test_a_planted_untyped_funnel_is_found(signature: str) -> None:
    source = f"class EmbeddingCache:\n    def _run{signature}: ...\n"
    assert not funnel_typed(source, "EmbeddingCache")


def test_mypy_rejects_a_step_given_the_wrong_arguments(tmp_path: Path) -> None:
    """What the typing buys: a step run with an argument of the wrong type, or one too many,
    fails mypy; the right ones pass."""
    wrong = tmp_path / "wrong_step.py"
    wrong.write_text(
        "from embcache import EmbeddingCache\n"
        "cache = EmbeddingCache(1 << 16)\n"
        "cache._run(cache._core.remove, None)\n"  # right
        "cache._run(cache._core.end_request, 'r1')\n"  # a str for a RequestState
        "cache._run(cache._core.open_request, 'r1', 'extra')\n"  # one argument too many
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", str(wrong)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [4, 5], done.stdout


@pytest.mark.parametrize("module", ["core/cache_core.py", "driver/request.py"])
def test_the_scanned_modules_exist(module: str) -> None:
    assert (PACKAGE / module).exists()
