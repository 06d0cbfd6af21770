"""The exit status of every command, in one table (README.md shows it), and which errors count as
bad input:

- 0: done: the executor was ready (``plan``, ``run``), the server stopped after a signal
  (``serve``), the command did its work (``trace``, ``cache``);
- 1: a stage failed at run time: out of memory after its retries, an I/O error, a failed smoke
  request; or ``run``'s generation failed after ready (a failed step, a rank that stopped);
- 2: bad input, found before the run or by a stage during it: an invalid flag or value, a
  configuration that cannot fit (the capacity stage's ``CapacityError``), a model that cannot be
  read, a missing extra, an unreadable trace file;
- 130, 143, 129: stopped by SIGINT (Ctrl-C), SIGTERM or SIGHUP (128 + the signal's number;
  ``serve`` exits 0 instead); every completed stage was rolled back.

The message always goes to stderr, one paragraph, no traceback.
"""

from __future__ import annotations

import textwrap

from bootstrap.capacity import CapacityError
from bootstrap.capacity.shape import ModelConfigError
from bootstrap.config import ConfigError
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.collective import failure_of
from bootstrap.pipeline.dependencies import GraphError
from bootstrap.pipeline.telemetry import MissingExtra

OK, STAGE_FAILED, BAD_INPUT, INTERRUPTED, TERMINATED, HUNG_UP = 0, 1, 2, 130, 143, 129
MEANINGS = {
    OK: "done (serve: stopped by SIGTERM or SIGINT, its normal end)",
    STAGE_FAILED: "a stage failed at run time (out of memory after its retries, I/O, a failed smoke request), "
    "or run's generation failed after ready",
    BAD_INPUT: "bad input, found before the run or by a stage (invalid value, a plan that cannot fit, "
    "an unreadable model or trace file, a missing extra)",
    INTERRUPTED: "interrupted (SIGINT, Ctrl-C); completed stages were rolled back",
    TERMINATED: "stopped by SIGTERM (128 + 15); completed stages were rolled back",
    HUNG_UP: "stopped by SIGHUP (128 + 1); completed stages were rolled back",
}
# ConfigError covers the engine's ModelSourceError and the trace reader's TraceFileError too.
BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    ModelConfigError,
    CapacityError,
    GraphError,
    MissingExtra,
)


def is_bad_input(error: BaseException) -> bool:
    """A stage failure whose cause is bad input, or a bad-input error itself."""
    cause = error.cause if isinstance(error, StageFailed) else error
    return isinstance(failure_of(cause), BAD_INPUT_ERRORS)


def exit_status(error: BaseException | None) -> int:
    if error is None:
        return OK
    return BAD_INPUT if is_bad_input(error) else STAGE_FAILED


def epilog() -> str:
    """The table for ``--help``, wrapped to 80 columns."""
    lines = ["exit status:"]
    for code, text in MEANINGS.items():
        lines += textwrap.wrap(text, 80, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    return "\n".join(lines)
