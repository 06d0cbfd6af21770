"""Ctrl-C while ``profiling``'s forward pass is in flight (issue 56, item 4): ``bootstrap run``
says at once what it waits for and that it cannot be cut short, a second Ctrl-C is acknowledged
the same way, and the run ends rolled back with 130. In process, real signals: the simulated
GPU's forward holds the device thread until each acknowledgement has reached stderr."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.exits import INTERRUPTED
from bootstrap.cli.main import main

WAIT = "rolling back profiling once the forward pass in flight is done (it cannot be cut short) ..."
FIRST, AGAIN = f"bootstrap: interrupted: {WAIT}", f"bootstrap: interrupted again: still {WAIT}"


class Stderr(io.StringIO):
    """stderr as the test reads it; ``said(text)`` waits until a line holding ``text`` was written."""

    def __init__(self) -> None:
        super().__init__()
        self._written = threading.Condition()

    def write(self, text: str) -> int:
        with self._written:
            count = super().write(text)
            self._written.notify_all()
        return count

    def said(self, text: str) -> bool:
        with self._written:
            return self._written.wait_for(lambda: text in self.getvalue(), timeout=60)


class ForwardInFlight(SimBackend):
    """A forward pass that is still running when Ctrl-C comes, twice."""

    def __init__(self, stderr: Stderr) -> None:
        super().__init__(sim_device("h100-80gb"))
        self.stderr = stderr
        self.acknowledged: list[bool] = []

    def profile(self, *args, **kwargs):
        for line in (FIRST, AGAIN):
            os.kill(os.getpid(), signal.SIGINT)
            self.acknowledged.append(self.stderr.said(line))  # said while this forward still runs
        return super().profile(*args, **kwargs)


def test_ctrl_c_twice_during_the_forward_says_what_it_waits_for_and_ends_rolled_back(monkeypatch):
    stderr = Stderr()
    backend = ForwardInFlight(stderr)
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: backend)
    code = main(["run", "--model", "llama-3.1-8b", "--no-plan-cache"])
    lines = stderr.getvalue().splitlines()
    assert code == INTERRUPTED and backend.acknowledged == [True, True], lines
    assert lines.index(FIRST) < lines.index(AGAIN) < lines.index("  profiling          done")
    assert lines[-1] == "bootstrap: interrupted; completed stages were rolled back"
    assert backend.device.live() == {}  # every stage rolled back: nothing left on the device
