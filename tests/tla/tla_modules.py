"""``tla/trace.py`` (the trace validator; ``tla/`` is not a package), loaded once by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TLA = Path(__file__).resolve().parents[2] / "tla"


def load_trace() -> ModuleType:
    """The module ``tla/trace.py``, as ``tla_trace`` (dataclasses look their module up by name)."""
    if "tla_trace" in sys.modules:
        return sys.modules["tla_trace"]
    spec = importlib.util.spec_from_file_location("tla_trace", TLA / "trace.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
