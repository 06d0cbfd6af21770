"""``bootstrap serve`` in a subprocess on a free localhost port (``--port 0``; the port is read
from uvicorn's start line), its log in a file, and a few waits the tests share; under ``--tp N``
the launcher's rank processes (``rank_pids``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).parents[2]
TESTS = ROOT / "tests"
STARTED = re.compile(r"Uvicorn running on (http://[\d.]+:\d+)")


class ServeProcess:
    def __init__(
        self, log: Path, *argv: str, pythonpath: tuple[Path, ...] = (), env: dict[str, str] | None = None
    ) -> None:
        paths = [str(ROOT), str(TESTS), *map(str, pythonpath)]  # TESTS: ``helpers`` for plugin modules
        environ = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
        self.log_path = log
        self._log = log.open("w")
        command = [sys.executable, "-m", "bootstrap.cli", "serve", "--device", "cpu", "--port", "0", *argv]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = self._wait_for_port()

    def log(self) -> str:
        return self.log_path.read_text()

    def _wait_for_port(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = STARTED.search(self.log())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"bootstrap serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        raise TimeoutError(f"bootstrap serve did not open its port within {timeout} s:\n{self.log()}")

    def wait_state(self, *states: str, timeout: float = 180.0) -> dict:
        """Poll ``/ready`` until its ``state`` is one of ``states``; return its body."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = httpx.get(f"{self.url}/ready", timeout=10).json()
            if body["state"] in states:
                return body
            time.sleep(0.05)
        raise TimeoutError(f"/ready never reached {states}; last: {body}\n{self.log()}")

    def wait_stage(self, stage: str, timeout: float = 180.0) -> dict:
        """Poll ``/ready`` until ``stage`` is the running one; return the body."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = httpx.get(f"{self.url}/ready", timeout=10).json()
            if body["stage"] == stage:
                return body
            time.sleep(0.02)
        raise TimeoutError(f"stage {stage} never ran; last: {body}\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def children(process: subprocess.Popen) -> list[int]:
    """The process's child processes, lowest pid first."""
    out = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout
    return sorted(int(pid) for pid in out.split())


def rank_pids(launcher: subprocess.Popen) -> list[int]:
    """The launcher's rank processes (its children running torch's spawn), rank 0 first."""
    return [pid for pid in children(launcher) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text page (labels matched exactly); KeyError if absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, label_text = key.partition("{")
        if sample == name and ",".join(sorted(label_text.rstrip("}").split(","))) == wanted:
            return float(value)
    raise KeyError(f"{name}{{{wanted}}} not in the metrics page")


def metric_or_0(page: str, name: str, **labels: str) -> float:
    """``metric``, or 0 for a sample the page does not have yet (a counter never incremented)."""
    try:
        return metric(page, name, **labels)
    except KeyError:
        return 0.0


def wait_metric(server: ServeProcess, name: str, value: float, timeout: float = 60.0, **labels: str) -> None:
    """Poll ``/metrics`` until the sample equals ``value``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric_or_0(httpx.get(f"{server.url}/metrics").text, name, **labels) == value:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{name}{labels} never reached {value}")
