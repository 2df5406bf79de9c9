"""The package's face: its overview, version and errors, as a user meets them first."""

from __future__ import annotations

import importlib.metadata
import pydoc

import embcache
from embcache import errors


def test_every_error_is_importable_from_the_package() -> None:
    from embcache import EmbCacheError, InvalidArgumentError

    assert InvalidArgumentError is errors.InvalidArgumentError
    assert issubclass(InvalidArgumentError, EmbCacheError) and issubclass(
        InvalidArgumentError, ValueError
    )
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.EmbCacheError)
    }
    assert defined <= set(embcache.__all__), defined - set(embcache.__all__)
    assert all(getattr(embcache, name) is getattr(errors, name) for name in defined)


def test_version_is_the_installed_distribution_s() -> None:
    assert embcache.__version__ == importlib.metadata.version("embcache")
    assert embcache.__version__[0].isdigit()


def test_help_starts_with_an_overview() -> None:
    text = pydoc.render_doc(embcache, renderer=pydoc.plaintext)
    overview = text[: text.index("PACKAGE CONTENTS")]
    for name in ("EmbeddingCache", "Request", "EncodePipeline", "concatenated", "Item", "stats()",
                 "EmbCacheError", "embcache.tools.metrics", "python -m embcache demo", "DESIGN.md"):
        assert name in overview, name
