"""Whether the core under test is the compiled one (docs/setup.md, "A compiled core": the
extension modules ``.ci/compile`` leaves beside the sources load in their place)."""

from __future__ import annotations

import importlib.machinery

import pytest

import embcache.core.actions


def core_is_compiled() -> bool:
    """True when ``embcache.core`` was loaded from mypyc's extension modules."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return str(embcache.core.actions.__file__).endswith(suffixes)


def not_on_the_compiled_core(why: str) -> pytest.MarkDecorator:
    """Skip a test on the compiled core only: ``why`` says what it patches that compiled
    callers do not see (they call each other in C, not through the module's attributes)."""
    return pytest.mark.skipif(core_is_compiled(), reason=f"the compiled core: {why}")
