"""Which build of the core runs: mypyc's extension modules ("compiled") or the sources ("pure").

``embcache/core/__init__.py`` calls ``choose()`` before any other module of the core loads.
Python loads an extension module before the ``.py`` file of the same name, so the compiled
modules a build left beside the sources (``setup.py``) run unless ``choose()`` points the
core's directory at a finder that sees only sources. It does that when ``EMBCACHE_PURE=1`` is
set (the run-time switch), and when a compiled module's source differs from the one it was
built from (``compiled-sources.sha256``, written by the build; an editable install after an
edit): then it warns once, naming the file, and the core runs pure until the next build.
Stale compiled code never runs. This module and ``__init__`` are never compiled.
"""

from __future__ import annotations

import hashlib
import importlib.machinery as machinery
import os
import sys
import warnings
from pathlib import Path

PURE_ENV = "EMBCACHE_PURE"
MANIFEST = "compiled-sources.sha256"
HERE = Path(__file__).parent


_chosen = ["pure"]  # what choose() decided: the build every module of the core loads as


def loaded_build() -> str:
    """``"compiled"`` when the core runs from mypyc's extension modules, else ``"pure"``."""
    return _chosen[0]


def choose() -> None:
    """Make the core's modules load from their sources when the compiled ones must not run.
    Where they may, Python's own finder loads each extension module before its source."""
    if os.environ.get(PURE_ENV) == "1":
        _load_sources()
        return
    if not _compiled_files():  # a pure build
        return
    stale = stale_source()
    if stale is None:
        _chosen[0] = "compiled"
        return
    warnings.warn(
        f"embcache: the compiled core is older than embcache/core/{stale}; running the pure "
        "core (rebuild: pip install -e ., or bash .ci/install)",
        RuntimeWarning,
        stacklevel=2,
    )
    _load_sources()


def stale_source() -> str | None:
    """Of the compiled build here, the first source that changed since it was built or whose
    compiled module is missing (or the manifest's name when it is missing), else None."""
    manifest = HERE / MANIFEST
    if not manifest.exists():
        return MANIFEST
    compiled = {name.split(".")[0] for name in _compiled_files()}
    for line in manifest.read_text().splitlines():
        digest, _, name = line.partition("  ")
        source = HERE / name
        if Path(name).stem not in compiled or not source.exists():
            return name
        if hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            return name
    return None


def _compiled_files() -> list[str]:
    suffixes = _extension_suffixes()
    return [p.name for p in HERE.iterdir() if p.name.endswith(suffixes)]


def _extension_suffixes() -> tuple[str, ...]:
    return tuple(machinery.EXTENSION_SUFFIXES)


def _load_sources() -> None:
    """Find the core's modules with a finder that knows sources and bytecode, not extensions
    (``sys.path_importer_cache`` holds the finder of each directory of a package's path)."""
    sources = (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES)
    bytecode = (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES)
    for entry in sys.modules["embcache.core"].__path__:
        sys.path_importer_cache[entry] = machinery.FileFinder(entry, sources, bytecode)
