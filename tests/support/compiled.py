"""Whether the core under test is the compiled one (docs/setup.md, "A compiled core": the
extension modules ``setup.py`` builds load in place of the sources unless
``embcache.core.build`` says otherwise)."""

from __future__ import annotations

import pytest

from embcache.core.build import loaded_build


def core_is_compiled() -> bool:
    """True when ``embcache.core`` runs from mypyc's extension modules."""
    return loaded_build() == "compiled"


def not_on_the_compiled_core(why: str) -> pytest.MarkDecorator:
    """Skip a test on the compiled core only: ``why`` says what it patches that compiled
    callers do not see (they call each other in C, not through the module's attributes). The
    full tier runs it in its pure step (``.ci/test``, step 6: ``EMBCACHE_PURE=1``)."""
    return pytest.mark.skipif(
        core_is_compiled(), reason=f"the compiled core (the pure step runs it): {why}"
    )
