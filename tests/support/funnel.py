"""The cache's step runner (``embcache.driver.runner.StepRunner.run``: the one place that runs a
core step and carries out its effects), for the tests that count its calls or plant a bug in
it: they replace the public ``run`` of the cache's public ``runner`` on that one instance, and
every ``Request`` of the cache (which holds the same runner) goes through the replacement."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Funnel = Callable[..., Any]


def replace_funnel(cache: Any, make: Callable[[Funnel], Funnel]) -> None:
    """Run every later step of ``cache`` through ``make(run)``, given the runner's ``run``: a
    callable taking ``(step, *args, **kwargs)``, as ``run`` does."""
    runner = cache.runner
    runner.run = make(runner.run)
