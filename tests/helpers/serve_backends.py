"""Test-only backends for ``bootstrap serve --backend-factory module:callable``: the native engine with a
gate that holds one stage until the test opens it, a stage that fails once, or slow steps.

Nothing here is read from the environment: a test writes a two-line plugin module naming the
options (``plugin_module``) and passes it on the command line.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bootstrap.backends.native.backend import NativeBackend
from bootstrap.backends.native.placement import device_for


class GatedBackend(NativeBackend):
    """``gate``: a FIFO; the backend method ``gated`` blocks until a writer opens it (``open_gate``).
    ``fail_once``: backend methods whose first call raises (``failure``: its message, ``{method}``
    the method's name). ``step_delay_s``: sleep before each
    forward of the started executor, so requests stay in flight long enough to be cut.
    ``stats_fail``: the started executor's ``engine_stats`` raises."""

    def __init__(
        self,
        config: Any,
        gate: str | None = None,
        gated: str = "load_model",
        fail_once: tuple[str, ...] = (),
        step_delay_s: float = 0.0,
        failure: str = "injected failure in {method} (test)",
        stats_fail: bool = False,
    ) -> None:
        super().__init__(*device_for(config.device))
        self.gate, self.gated, self.step_delay_s, self.stats_fail = gate, gated, step_delay_s, stats_fail
        self.failures_left, self.failure = set(fail_once), failure

    def _enter(self, method: str) -> None:
        if self.gate and method == self.gated:
            with open(self.gate, "rb"):  # blocks until the test opens the FIFO for writing
                pass
        if method in self.failures_left:
            self.failures_left.discard(method)
            raise RuntimeError(self.failure.format(method=method))

    def load_model(self, *args: Any) -> Any:
        self._enter("load_model")
        return super().load_model(*args)

    def build_estimation(self, *args: Any) -> Any:
        self._enter("build_estimation")
        return super().build_estimation(*args)

    def build_final(self, *args: Any) -> Any:
        self._enter("build_final")
        return super().build_final(*args)

    def start_executor(self, *args: Any) -> Any:
        executor = super().start_executor(*args)
        if self.stats_fail:  # what the engine's process reads of a started executor for its channel

            def stats() -> Any:
                raise RuntimeError("injected failure in engine_stats (test)")

            executor.engine_stats = stats
        if self.step_delay_s:
            run = executor.runner.run

            def slow_run(batch: Any, *args: Any) -> Any:
                time.sleep(self.step_delay_s)
                return run(batch, *args)

            executor.runner.run = slow_run
        return executor


def factory(**options: Any) -> Any:
    return lambda config: GatedBackend(config, **options)


def plugin_module(directory: Path, **options: Any) -> str:
    """Write a plugin module into ``directory`` (put it on PYTHONPATH); return its --backend-factory spec."""
    name = f"serve_plugin_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(
        f"from helpers.serve_backends import factory\n\nbackend = factory(**{options!r})\n"
    )
    return f"{name}:backend"


def open_gate(gate: Path, timeout: float = 120.0) -> None:
    """Open the FIFO for writing (so the gated stage goes on); fails if nobody reads it in time."""
    opened = threading.Event()

    def writer() -> None:
        with open(gate, "wb"):
            opened.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    if not opened.wait(timeout):
        with open(gate, "rb"):  # unblock our own writer before failing
            pass
        raise TimeoutError(f"nobody reached the gate {gate} within {timeout} s")
    thread.join()
