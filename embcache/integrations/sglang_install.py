"""Turn embcache's controller on inside SGLang's encoder server, in every TP rank.

SGLang has no flag for another controller: ``MMEncoder.__init__`` imports
``EmbeddingCacheController`` from ``sglang.srt.mem_cache.embedding_cache_controller`` when it
runs, in every TP process, and those are spawned (fresh interpreters). So the module attribute
must be replaced in each process before ``MMEncoder`` is built. Two ways:

- ``install()``: in this process, now. It imports SGLang's module, checks that SGLang's class
  has exactly the methods and signatures embcache implements, and replaces the attribute. Call
  it at the top level of your own launch script (a spawned rank re-runs the main module's top
  level).
- The opt-in hook: ``python -m embcache.integrations.sglang_install enable`` writes
  ``embcache_sglang.pth`` into site-packages. Every interpreter of that environment started
  with ``EMBCACHE_SGLANG=1`` then patches SGLang's module the moment it is imported: the line
  registers an import hook written in the standard library alone (site-packages folders are
  still being added when it runs), which imports embcache only when SGLang's module is
  imported; without the variable the line does nothing but read it. Spawned ranks inherit the
  environment, so every rank is patched. ``disable`` removes the file.

Either way a wrong SGLang fails loudly: ``SGLangIntegrationError`` says whether SGLang is
missing or which methods differ, and what to do. The ``.pth`` line imports nothing unless
``EMBCACHE_SGLANG=1``: other Python processes of the environment start as fast as before.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import sysconfig
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from embcache.errors import EmbCacheError

MODULE = "embcache.integrations.sglang_install"  # this module, also when run as __main__
TARGET = "sglang.srt.mem_cache.embedding_cache_controller"
CLASS_NAME = "EmbeddingCacheController"
ENV = "EMBCACHE_SGLANG"
PTH_NAME = "embcache_sglang.pth"
HOOK = "EmbcacheSGLangHook"  # the finder the .pth line registers, before sys.path is complete
PTH_LINE = (
    f'import os, sys; os.environ.get("{ENV}", "") == "1" and sys.meta_path.insert(0, type('
    f'"{HOOK}", (), {{"find_spec": staticmethod(lambda name, path=None, target=None: '
    f'__import__("{MODULE}", fromlist=["find_spec"]).find_spec(name, path, target) '
    f'if name == "{TARGET}" else None)}})())\n'
)
INTERFACE_VERSION = "0.5.23"
_ORIGINAL = "_embcache_original_controller"


class SGLangIntegrationError(EmbCacheError, RuntimeError):
    """SGLang is not importable, or its controller has another interface than embcache's."""


def interface_differences(theirs: type, ours: type) -> list[str]:
    """How ``ours`` fails to stand in for ``theirs``: every public method of ``theirs`` must
    exist on ``ours`` with the same parameters (names, kinds, defaults; annotations are not
    compared) and be a coroutine function exactly where it is one. Empty when it can."""
    differences = []
    for name, method in inspect.getmembers(theirs, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        mine = getattr(ours, name, None)
        if not inspect.isfunction(mine):
            differences.append(f"{name}: missing")
            continue
        want, got = _parameters(method), _parameters(mine)
        if want != got:
            differences.append(f"{name}: SGLang has ({_show(want)}), embcache ({_show(got)})")
        if inspect.iscoroutinefunction(method) != inspect.iscoroutinefunction(mine):
            differences.append(f"{name}: async in one, not in the other")
    return differences


def install() -> type:
    """Replace SGLang's controller by embcache's in this process; returns SGLang's class.
    Raises ``SGLangIntegrationError`` if SGLang is not importable or differs."""
    try:
        module = importlib.import_module(TARGET)
    except ImportError as exc:
        raise SGLangIntegrationError(
            f"cannot import {TARGET} ({exc}): install SGLang {INTERFACE_VERSION} in this "
            f"environment (pip install 'sglang=={INTERFACE_VERSION}'), or unset {ENV}"
        ) from exc
    return _patch(module)


def uninstall() -> None:
    """Put SGLang's own controller back where ``install`` or the hook replaced it."""
    module = sys.modules.get(TARGET)
    if module is not None and hasattr(module, _ORIGINAL):
        setattr(module, CLASS_NAME, getattr(module, _ORIGINAL))
        delattr(module, _ORIGINAL)
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_hook(f)]


def activate() -> None:
    """Patch SGLang's module now if it is imported already, else when it is (the hook)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def find_spec(
    fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
) -> importlib.machinery.ModuleSpec | None:
    """The spec of SGLang's controller module from the other finders, its loader wrapped so
    that the module is patched once it has run; None for any other module."""
    if fullname != TARGET:
        return None
    for finder in sys.meta_path:
        if _is_hook(finder) or not hasattr(finder, "find_spec"):
            continue
        spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchLoader(spec.loader)
            return spec
    return None


def _is_hook(finder: object) -> bool:
    return isinstance(finder, _PatchOnImport) or type(finder).__name__ == HOOK


def _patch(module: ModuleType) -> type:
    from embcache.integrations.sglang import EmbeddingCacheController

    current = getattr(module, CLASS_NAME, None)
    if current is EmbeddingCacheController:
        original: type = getattr(module, _ORIGINAL)
        return original
    if not isinstance(current, type):
        raise SGLangIntegrationError(
            f"{TARGET} has no class {CLASS_NAME} (SGLang {_version()}): embcache implements "
            f"the interface of SGLang {INTERFACE_VERSION}; install that version or unset {ENV}"
        )
    differences = interface_differences(current, EmbeddingCacheController)
    if differences:
        raise SGLangIntegrationError(
            f"SGLang {_version()}'s {CLASS_NAME} is not the interface embcache implements "
            f"(SGLang {INTERFACE_VERSION}): {'; '.join(differences)}. Install sglang=="
            f"{INTERFACE_VERSION} or unset {ENV}"
        )
    setattr(module, _ORIGINAL, current)
    setattr(module, CLASS_NAME, EmbeddingCacheController)
    return current


class _PatchLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it made."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """``find_spec`` as a finder, for ``activate``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return find_spec(fullname, path, target)


def _parameters(function: Any) -> list[tuple[str, str, str]]:
    return [
        (p.name, p.kind.name, repr(p.default))
        for p in inspect.signature(function).parameters.values()
    ]


def _show(parameters: list[tuple[str, str, str]]) -> str:
    return ", ".join(
        name if default == repr(inspect.Parameter.empty) else f"{name}={default}"
        for name, _, default in parameters
    )


def _version() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def main(argv: Sequence[str] | None = None) -> int:
    """``enable`` / ``disable`` / ``status`` of the ``.pth`` hook in a site-packages folder."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description=f"Turn embcache's SGLang controller on for processes started with {ENV}=1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("action", choices=["enable", "disable", "status"])
    parser.add_argument(
        "--site-dir",
        type=Path,
        default=Path(sysconfig.get_paths()["purelib"]),
        help="the site-packages folder of the environment SGLang runs in",
    )
    args = parser.parse_args(argv)
    pth: Path = args.site_dir / PTH_NAME
    if args.action == "enable":
        pth.write_text(PTH_LINE)
        print(f"wrote {pth}; start SGLang with {ENV}=1 to use embcache's controller")
    elif args.action == "disable":
        pth.unlink(missing_ok=True)
        print(f"removed {pth}")
    else:
        state = "enabled" if pth.exists() and pth.read_text() == PTH_LINE else "not enabled"
        print(f"{pth}: {state}; {ENV}={os.environ.get(ENV, '')!r} in this environment")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
