"""executor-bootstrap: LLM executor creation as an async pipeline of explicit, traced stages.

``build_executor``, ``executor``, ``Bootstrap`` and ``BootstrapConfig`` are imported lazily, so
``import bootstrap`` stays light (the planner needs no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Bootstrap": "bootstrap.api",
    "BootstrapReport": "bootstrap.api",
    "build_executor": "bootstrap.api",
    "executor": "bootstrap.api",
    "BootstrapConfig": "bootstrap.config",
    "StageFailed": "bootstrap.pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bootstrap' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
