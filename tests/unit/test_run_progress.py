"""``bootstrap run`` while a stage runs long (issue 56, item 1): past two seconds it shows which
stage, for how long and what it waits for; a plain line (again every ten seconds) where stderr
is a pipe or a file, rich's status line on an interactive terminal. In process: the simulated
GPU's forward pass holds the device thread until the progress has reached stderr."""

from __future__ import annotations

import io
import re
import sys
import threading

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.main import main

LINE = re.compile(r"^  profiling          still running after \d+ s \(the forward pass in flight\)$", re.M)
STATUS = re.compile(r"profiling \d+ s \(the forward pass in flight\)")


class Stderr(io.StringIO):
    """stderr as the test reads it; ``shows(pattern)`` waits until what was written matches."""

    def __init__(self) -> None:
        super().__init__()
        self._written = threading.Condition()

    def write(self, text: str) -> int:
        with self._written:
            count = super().write(text)
            self._written.notify_all()
        return count

    def shows(self, pattern: re.Pattern) -> bool:
        with self._written:
            return self._written.wait_for(lambda: pattern.search(self.getvalue()) is not None, timeout=60)


class LongForward(SimBackend):
    """A forward pass that runs until ``pattern`` has reached stderr."""

    def __init__(self, stderr: Stderr, pattern: re.Pattern) -> None:
        super().__init__(sim_device("h100-80gb"))
        self.stderr, self.pattern, self.shown = stderr, pattern, []

    def profile(self, *args, **kwargs):
        self.shown.append(self.stderr.shows(self.pattern))
        return super().profile(*args, **kwargs)


def run_with(monkeypatch, pattern: re.Pattern) -> tuple[LongForward, str]:
    stderr = Stderr()
    backend = LongForward(stderr, pattern)
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: backend)
    main(["run", "--model", "llama-3.1-8b", "--no-plan-cache"])  # the simulated executor takes no prompt: exit 2
    return backend, stderr.getvalue()


def test_a_long_stage_gets_a_line_saying_what_it_waits_for(monkeypatch):
    backend, err = run_with(monkeypatch, LINE)
    assert backend.shown == [True], err
    lines = err.splitlines()
    waited = [i for i, line in enumerate(lines) if LINE.match(line)]
    assert len(waited) == 1 and waited[0] < lines.index("  profiling          done")
    assert not any("still running" in line for line in lines if not line.startswith("  profiling "))


def test_on_a_terminal_it_is_a_status_line_instead(monkeypatch):
    for name, value in {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "TERM": "xterm-256color"}.items():
        monkeypatch.setenv(name, value)  # rich's own switches: stderr is taken for an interactive terminal
    backend, err = run_with(monkeypatch, STATUS)
    assert backend.shown == [True], err
    assert "still running after" not in err and "profiling          \x1b[32mdone" in err
