"""Docstrings as contracts (issue 54, point 4): a module docstring of ``embcache/`` states its
contract in at most ``MAX_MODULE_DOCSTRING`` lines (design notes and measurements go to docs/),
and every name of an embcache object given in backticks resolves, so a rename or a removal that
leaves a stale name behind fails here.

Where names are read: the code spans (``x`` or `x`) of every docstring of ``embcache/`` (module,
class, function, method) and of README.md, CONTRIBUTING.md, embcache/DESIGN.md and docs/*.md
(fenced blocks left out: tests/test_docs.py runs the README's examples). In a span, a name of
an embcache object is:
- a dotted name that starts with ``embcache.`` (``embcache.core.policy``,
  ``embcache.testing.FaultInjectingStore``): its longest module prefix imports and each part
  after it is an attribute (``embcache.core.policy:AdaptivePolicy``, a benchmark's
  ``module:name``, resolves by its module part);
- ``Class.member``, where ``Class`` is a public class defined at the top of a module of
  ``embcache/`` and the name does not follow a dot (``CacheCore.queries``,
  ``EmbeddingCache._run``; ``vllm.Request.x`` is vLLM's, ``tla/EmbeddingCache.tla`` a file):
  some class of that name has it;
- in a docstring of ``embcache/``, a private name alone (``_wait_async``): its module defines
  it, at the top or as a member of one of its classes.
A class's member is an attribute of the class (a method, property, constant or enum member,
through its bases), an annotated field, or an attribute its methods or an embcache base's set
(``self.x = ...``). A module that needs an optional dependency missing here (vLLM's connector)
is read from its source instead of imported. Each check is shown to fail on a planted stale name.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embcache"
MAX_MODULE_DOCSTRING = 40
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    PACKAGE / "DESIGN.md",
    *sorted((ROOT / "docs").glob("*.md")),
]

FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
DOTTED = re.compile(r"(?<![\w.])embcache(?:\.\w+)+")
MEMBER = re.compile(r"(?<![\w./])([A-Z]\w*)\.(\w+)")
FILE_SUFFIXES = {"tla", "cfg", "py", "md", "json", "toml", "txt", "png", "so"}
PRIVATE = re.compile(r"(_[A-Za-z]\w*)(?:\(\))?")


# ----------------------------------------------------------------------------- docstring length
def module_docstring_lines(source: str) -> int:
    """Source lines the module docstring of ``source`` spans (0: none)."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_docstring_states_its_contract_in_at_most_40_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in modules()
        if (lines := module_docstring_lines(path.read_text())) > MAX_MODULE_DOCSTRING
    ]
    assert len(modules()) > 40  # the walk found the package
    assert not long, (
        f"module docstrings over {MAX_MODULE_DOCSTRING} lines (state the contract; move design "
        "notes and measurements to docs/):\n" + "\n".join(long)
    )


def test_a_planted_long_module_docstring_is_found() -> None:
    forty = '"""' + "a line of contract\n" * (MAX_MODULE_DOCSTRING - 1) + '"""\n\nX = 1\n'
    assert module_docstring_lines(forty) == MAX_MODULE_DOCSTRING
    assert module_docstring_lines(forty.replace('"""\n', 'one more\n"""\n', 1)) == 41
    assert module_docstring_lines("X = 1\n") == 0


# ----------------------------------------------------------------------------- names in backticks
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path | None:
    """The source of module ``name`` (``embcache...``), or None when there is none."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def top_names(path: Path) -> set[str]:
    """Names the module at ``path`` binds at its top: definitions, assignments, imports."""
    names: set[str] = set()
    for node in tree(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Try | ast.If):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {
                n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.ClassDef)
            }
            names |= {
                (a.asname or a.name).split(".")[0]
                for n in ast.walk(node)
                if isinstance(n, ast.Import | ast.ImportFrom)
                for a in n.names
            }
        else:
            names |= {
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
    return names


@cache
def class_index() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Public class name -> (module, definition) of every class at the top of a module."""
    index: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in modules():
        for node in tree(path).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                index.setdefault(node.name, []).append((module_name(path), node))
    return index


def static_members(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> set[str]:
    """What class ``node`` defines in its body, sets on ``self``, lists in ``__slots__``, and
    what its bases that are embcache classes (by name) define so."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(item.name)
        elif isinstance(item, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                value = item.value
                names |= {
                    c.value
                    for c in ast.walk(value) if value is not None
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }  # fmt: skip
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
            targets = [sub.target]
        names |= {
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        }  # fmt: skip
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if name in class_index() and name not in seen:
            for _, definition in class_index()[name]:
                names |= static_members(definition, seen | {node.name})
    return names


def has_member(cls: type, member: str) -> bool:
    """Whether ``member`` is an attribute, an annotated field or a ``self`` attribute of
    ``cls`` (through its bases)."""
    if hasattr(cls, member):
        return True
    for klass in cls.__mro__:
        if member in vars(klass).get("__annotations__", {}):
            return True
        path = module_path(klass.__module__)
        if klass.__module__.startswith("embcache") and path is not None:
            definitions = [
                n for n in tree(path).body
                if isinstance(n, ast.ClassDef) and n.name == klass.__name__
            ]  # fmt: skip
            if any(member in static_members(d) for d in definitions):
                return True
    return False


def optional_missing(error: ModuleNotFoundError) -> bool:
    """Whether the import failed for a dependency outside embcache (vLLM, say)."""
    return not (error.name or "").startswith("embcache")


def resolves_statically(module: str, rest: list[str]) -> bool:
    """``rest`` read from the source of ``module`` (whose import needs a missing dependency)."""
    path = module_path(module)
    if path is None or not rest:
        return path is not None
    if rest[0] not in top_names(path):
        return False
    if len(rest) == 1:
        return True
    classes = [n for n in tree(path).body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
    if not classes:  # a re-export: the name's own module is imported
        classes = [d for _, d in class_index().get(rest[0], [])]
    return len(rest) == 2 and any(rest[1] in static_members(c) for c in classes)


def dotted_resolves(name: str) -> bool:
    """Whether ``embcache.a.b...`` imports (its longest module prefix) and has every part."""
    parts = name.split(".")
    cut = next(i for i in range(len(parts), 0, -1) if module_path(".".join(parts[:i])))
    module, rest = ".".join(parts[:cut]), parts[cut:]
    try:
        obj: object = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if optional_missing(error):
            return resolves_statically(module, rest)
        raise
    for i, part in enumerate(rest):
        if isinstance(obj, type) and i == len(rest) - 1:
            return has_member(obj, part)
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def member_resolves(cls_name: str, member: str) -> bool:
    """Whether some embcache class called ``cls_name`` has ``member``."""
    for module, definition in class_index()[cls_name]:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except ModuleNotFoundError as error:
            if not optional_missing(error):
                raise
            if member in static_members(definition):
                return True
            continue
        if has_member(cls, member):
            return True
    return False


def private_resolves(name: str, module: str) -> bool:
    """Whether ``module`` defines private ``name`` at its top or in one of its classes."""
    path = module_path(module)
    assert path is not None, module
    if name in top_names(path):
        return True
    classes = [n for n in ast.walk(tree(path)) if isinstance(n, ast.ClassDef)]
    return any(name in static_members(c) for c in classes)


def code_spans(text: str) -> list[str]:
    """The contents of the code spans of ``text`` (fenced blocks left out), blanks as one."""
    return [" ".join(m.group(2).split()) for m in SPAN.finditer(FENCE.sub("", text))]


def stale_names(text: str, module: str | None) -> list[str]:
    """The names of embcache objects in ``text``'s code spans that resolve to nothing; private
    names alone count where ``module`` (the docstring's) is given."""
    stale: list[str] = []
    for span in code_spans(text):
        stale += [name for name in DOTTED.findall(span) if not dotted_resolves(name)]
        stale += [
            f"{cls}.{member}"
            for cls, member in MEMBER.findall(span)
            if cls in class_index()
            and member not in FILE_SUFFIXES
            and not member_resolves(cls, member)
        ]
        private = PRIVATE.fullmatch(span)
        if module is not None and private and not private_resolves(private.group(1), module):
            stale.append(private.group(1))
    return stale


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring in the module at ``path``: the module's, each class's
    and each function's."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                found.append((getattr(node, "lineno", 1), text))
    return found


def stale_in_package() -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in modules()
        for line, text in docstrings(path)
        for name in stale_names(text, module_name(path))
    ]


def stale_in_documents() -> list[str]:
    return [
        f"{path.relative_to(ROOT)}: {name}"
        for path in DOCUMENTS
        for name in stale_names(path.read_text(), None)
    ]


def test_every_embcache_name_in_a_docstring_resolves() -> None:
    stale = stale_in_package()
    assert not stale, "docstrings name what does not exist (rename or drop):\n" + "\n".join(stale)


def test_every_embcache_name_in_the_documents_resolves() -> None:
    assert len(DOCUMENTS) > 8  # the README, CONTRIBUTING, DESIGN and docs/
    stale = stale_in_documents()
    assert not stale, "documents name what does not exist (rename or drop):\n" + "\n".join(stale)


def test_the_scan_reads_names_in_each_form() -> None:
    """The forms above are read (so a passing scan is not an empty one)."""
    text = (
        "``embcache.core.policy`` and ``embcache.testing.FaultInjectingStore.put_from`` and"
        " `CacheCore.queries` and ``EmbeddingCache.lookup(id, items)`` and ``Status.HIT`` and"
        " ``TinyLfuPolicy.halvings`` (set on self) and ``Footprint.ghosts`` (a field) and"
        " ``embcache.core.policy:AdaptivePolicy`` and ``embcache.integrations.vllm.ranks``"
        " and ``vllm.Request.anything`` (vLLM's) and ``Nobody.knows`` (not ours)\n"
        "```\nembcache.not_a_name_in_a_fence\n```\n"
    )
    assert stale_names(text, None) == []
    work = "embcache.core.policy_adaptive_work"  # _haunt its own, _past_doorkeeper its base's
    assert stale_names("``_haunt`` ``_past_doorkeeper()``", work) == []
    assert stale_names("``tla/EmbeddingCache.tla``, ``EmbeddingCache.tla``", None) == []


def test_planted_stale_names_are_found() -> None:
    text = (
        "``embcache.core.policy.NoSuchPolicy`` and ``embcache.core.nowhere.thing`` and"
        " `CacheCore.pinned_since` and ``EmbeddingCache._wait_async`` and"
        " ``TinyLfuPolicy.no_such_field`` and ``embcache.integrations.vllm.ranks.gone`` and\n"
        "``embcache.core.sketch.FrequencySketch.gone`` and ``_nowhere``"
    )
    stale = [
        "embcache.core.policy.NoSuchPolicy",
        "embcache.core.nowhere.thing",
        "embcache.integrations.vllm.ranks.gone",
        "CacheCore.pinned_since",
        "EmbeddingCache._wait_async",
        "TinyLfuPolicy.no_such_field",
        "embcache.core.sketch.FrequencySketch.gone",
    ]
    assert sorted(stale_names(text, None)) == sorted(stale)
    assert sorted(stale_names(text, "embcache.driver.cache")) == sorted([*stale, "_nowhere"])
