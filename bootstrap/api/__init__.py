"""The Python API: build a real, started executor through the stages, and change it live.

    executor, report = await bootstrap.build_executor(config)   # you own the executor
    async with bootstrap.executor(config) as ex: ...             # released on exit

``Bootstrap`` (``boot``) is the object both (and the CLI and the server) use: one pipeline at a
time, its spans and its report, and the live operations (``operations``): ``swap``,
``update_weights``, ``sleep``, ``wake``. ``factory`` makes the pipeline and the backend.
"""

from bootstrap.api.boot import Bootstrap, BootstrapReport
from bootstrap.api.build import build_executor, executor, shut_down_at_exit
from bootstrap.api.factory import default_backend, make_pipeline, require_engine
from bootstrap.api.operation_terms import Busy, OperationRecord, Refused, Reverted

__all__ = [
    "Bootstrap",
    "BootstrapReport",
    "Busy",
    "OperationRecord",
    "Refused",
    "Reverted",
    "build_executor",
    "default_backend",
    "executor",
    "make_pipeline",
    "require_engine",
    "shut_down_at_exit",
]
