"""The build (docs/setup.md, "A compiled core"): setuptools, with mypyc compiling the core.

With a C compiler and the Python headers, mypyc (it comes with mypy, a build requirement in
pyproject.toml) compiles every module of ``embcache/core`` but ``NOT_COMPILED`` into C
extension modules, as black and mypy build their own wheels. Without a compiler, or with
``EMBCACHE_PURE=1`` in the build's environment, the package is pure Python, and the build prints
one line saying so. Either way the wheel and the editable install hold the same ``.py`` files.

A compiled build also writes ``embcache/core/compiled-sources.sha256``: the sha256 of each
source it compiled (``sha256sum`` format). ``embcache.core.build`` reads it at import and loads
the sources instead of the extension modules when one of them changed since (an editable
install after an edit) or when ``EMBCACHE_PURE=1`` is set at run time. A pure build removes the
compiled files an earlier build left in the tree (an editable install builds them in place), so
a pure build never runs compiled code. Everything here runs at build time only.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CORE = ROOT / "embcache" / "core"
# __init__ and build choose at import which build loads, so they stay Python.
NOT_COMPILED = {"__init__", "build"}
MANIFEST = CORE / "compiled-sources.sha256"
PURE_ENV = "EMBCACHE_PURE"
GROUP = "embcache.core.compiled"  # the shared library: embcache.core.compiled__mypyc
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
IN_PLACE_COMMANDS = {"editable_wheel", "develop"}  # they build the extension modules in the tree


def compiled_sources() -> list[Path]:
    """The modules mypyc compiles: every ``embcache/core/*.py`` but ``NOT_COMPILED``."""
    return sorted(p for p in CORE.glob("*.py") if p.stem not in NOT_COMPILED)


def why_pure() -> str | None:
    """Why this build is pure Python (forced, no compiler, no headers), or None to compile."""
    if os.environ.get(PURE_ENV) == "1":
        return f"{PURE_ENV}=1"
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({compiler[0] if compiler else 'CC is empty'} not found)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        return f"no Python headers ({headers} not found; Debian: apt-get install python3-dev)"
    return None


def remove_compiled() -> None:
    """Remove what an earlier in-place (editable) compiled build left beside the sources."""
    for path in [*CORE.glob("*.so"), *CORE.glob("*.pyd"), *CORE.parent.glob("core__mypyc.*")]:
        path.unlink()  # core__mypyc: where .ci/compile, now gone, put the shared library
    MANIFEST.unlink(missing_ok=True)


def write_manifest(sources: list[Path]) -> None:
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sources]
    MANIFEST.write_text("".join(lines))


def builds() -> bool:
    """Whether this run of setup.py builds (a wheel, an editable install, build_ext); the
    metadata steps a build backend runs first (egg_info, dist_info) compile nothing."""
    return bool(BUILD_COMMANDS & set(sys.argv[1:]))


def extensions() -> list[object]:
    """mypyc's extension modules for the core, or none (a pure build, after one line)."""
    if not builds():
        return []
    os.chdir(ROOT)  # mypyc names modules from paths relative to the project's root
    reason = why_pure()
    if reason is not None:
        if IN_PLACE_COMMANDS & set(sys.argv[1:]):
            remove_compiled()  # or they would still load, with their digests
        print(f"embcache: building pure Python: {reason}", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    sources = compiled_sources()
    remove_compiled()
    write_manifest(sources)
    print(f"embcache: compiling {len(sources)} core modules with mypyc", file=sys.stderr)
    # group_name puts the library the modules share beside them
    # (embcache/core/compiled__mypyc), not at the top of site-packages under a hashed name
    return list(
        mypycify(
            [str(p.relative_to(ROOT)) for p in sources],
            group_name=GROUP,
            opt_level="3",
        )
    )


if __name__ == "__main__":  # as build backends run it; tests/test_compiled.py imports it
    modules = extensions()
    # the digests go with the compiled modules only: a pure wheel built in a tree where an
    # editable compiled build left them must not carry them
    setup(ext_modules=modules, package_data={"embcache.core": [MANIFEST.name] if modules else []})
