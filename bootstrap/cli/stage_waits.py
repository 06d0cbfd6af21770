"""``bootstrap run``'s progress while a stage runs longer than ``SHOWN_AFTER_S``: on an interactive
terminal, rich's status line (a spinner, each such stage with its seconds so far and what it waits
for), gone once they end; elsewhere (a pipe, a log file) a plain line then, and again every
``LINE_EVERY_S`` while it runs."""

from __future__ import annotations

import time
from typing import Any

import anyio
from rich.console import Console
from rich.text import Text

SHOWN_AFTER_S = 2.0
LINE_EVERY_S = 10.0
TICK_S = 0.25
IN_FLIGHT = {  # what a stage waits for: work on the device thread, which runs to its end
    "load_model": "the weights being read",
    "estimation_build": "the probe KV cache being allocated",
    "profiling": "the forward pass in flight",
    "final_build": "the KV cache being allocated",
    "warmup": "the CUDA graph capture in flight",
    "scheduler_sampler": "the executor's start",
}


def in_flight(stage: str) -> str:
    return IN_FLIGHT.get(stage, "the work in flight")


class StageWaits:
    """The stages running now (``started``, ``ended``) and their progress, shown by ``run``."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.running: dict[str, float] = {}
        self.next_line: dict[str, float] = {}
        self.status: Any = None

    def started(self, stage: str) -> None:
        self.running[stage] = time.monotonic()
        self.next_line[stage] = SHOWN_AFTER_S

    def ended(self, stage: str) -> None:
        self.running.pop(stage, None)
        self.show()

    def show(self) -> None:
        now = time.monotonic()
        slow = {stage: now - since for stage, since in self.running.items() if now - since >= SHOWN_AFTER_S}
        if self.console.is_interactive:
            self._status(slow)
            return
        for stage, seconds in slow.items():
            if seconds >= self.next_line[stage]:
                line = f"  {stage:<18} still running after {seconds:.0f} s ({in_flight(stage)})"
                self.console.print(Text(line, style="dim"), highlight=False, soft_wrap=True)
                self.next_line[stage] = seconds + LINE_EVERY_S

    def _status(self, slow: dict[str, float]) -> None:
        if not slow:
            self.stop()
            return
        text = "; ".join(f"{stage} {seconds:.0f} s ({in_flight(stage)})" for stage, seconds in slow.items())
        if self.status is None:
            self.status = self.console.status(Text(text))
            self.status.start()
        else:
            self.status.update(Text(text))

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    async def run(self) -> None:
        """Show the waits every ``TICK_S`` until cancelled; the status line goes with it."""
        try:
            while True:
                await anyio.sleep(TICK_S)
                self.show()
        finally:
            self.stop()
