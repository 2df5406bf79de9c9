"""``tla/trace.py`` and ``tla/claims_trace.py`` (the trace validators; ``tla/`` is not a
package), each loaded once by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TLA = Path(__file__).resolve().parents[2] / "tla"


def load_trace() -> ModuleType:
    """The module ``tla/trace.py``, as ``tla_trace`` (dataclasses look their module up by name)."""
    return _load("tla_trace", "trace.py")


def load_claims_trace() -> ModuleType:
    """The module ``tla/claims_trace.py``, as ``tla_claims_trace``."""
    return _load("tla_claims_trace", "claims_trace.py")


def _load(name: str, file: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TLA / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
