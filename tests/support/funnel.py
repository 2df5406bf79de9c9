"""The cache's funnel (``EmbeddingCache._run``: the one place that runs a core step and carries
out its effects), for the tests that count its calls or plant a bug in it. The only place a test
reaches it: the funnel has no public seam, since no caller may change how a cache runs a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Funnel = Callable[..., Any]


def replace_funnel(cache: Any, make: Callable[[Funnel], Funnel]) -> None:
    """Run every later step of ``cache`` through ``make(funnel)``, given the funnel it had: a
    callable taking ``(step, *args)``, as the funnel does."""
    # private: the funnel itself is counted or planted (no public seam offers it)
    cache._run = make(cache._run)
