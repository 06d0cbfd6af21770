"""executor-bootstrap: LLM executor creation as an async pipeline of explicit, traced stages.

``build_executor``, ``executor``, ``Bootstrap`` and ``BootstrapConfig`` are imported lazily, so
``import bootstrap`` stays light (the planner needs no torch).
"""

from __future__ import annotations

import importlib
import time
from typing import Any

# the interpreter's first moment in this package, and the CPU it had spent by then: its start as it
# measures it (``pipeline.process.spawn_time_ns``), taken before any other import of the project's
FIRST_MOMENT_NS, CPU_BEFORE_NS = time.time_ns(), time.process_time_ns()

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
