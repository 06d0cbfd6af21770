"""The exit status of every command, in one table (README.md shows it; ``COMMAND_MEANINGS``: each
command's own rows, for its ``--help``), and which errors count as bad input:

- 0: done: the executor was ready (``plan``, ``run``), the server stopped after a signal
  (``serve``), the command did its work (``trace``, ``cache``);
- 1: a stage failed at run time (out of memory after its retries, I/O, a failed smoke request);
  ``run``'s generation failed after ready; ``serve``'s engine process exited unasked;
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
ROLLED_BACK = "completed stages were rolled back"
COMMAND_MEANINGS: dict[str, dict[int, str]] = {  # each command's --help: the statuses it can end with
    "plan": {
        OK: "done: every stage ran on the simulated GPU and the plan was printed",
        STAGE_FAILED: "a stage failed (out of memory after its retries, e.g. from --fault)",
        BAD_INPUT: "bad input (an invalid flag or value, a plan that cannot fit, an unreadable model config)",
        INTERRUPTED: f"interrupted (SIGINT, Ctrl-C); {ROLLED_BACK}",
    },
    "run": {OK: "done: the executor was ready and answered"}
    | {code: MEANINGS[code] for code in (STAGE_FAILED, BAD_INPUT, INTERRUPTED, TERMINATED, HUNG_UP)},
    "serve": {
        OK: "stopped by SIGTERM, SIGINT or SIGHUP, its normal end (a bootstrap in progress rolled back)",
        STAGE_FAILED: "the engine's process exited unasked (killed, out of memory), "
        "or the ranks fell out of step (--tp N)",
        BAD_INPUT: "bad input: the configuration (before the port opens), a port that cannot be bound, "
        "a backend or trace file that cannot be used",
    },
    "trace": {
        OK: "done: the timelines were printed",
        BAD_INPUT: "bad input (an invalid flag, a trace file that cannot be read, --png without the plot extra)",
        INTERRUPTED: "interrupted (SIGINT, Ctrl-C)",
    },
    "cache": {
        OK: "done: listed, or every entry deleted",
        STAGE_FAILED: "clear could not delete an entry (each is named on stderr)",
        BAD_INPUT: "bad input (an invalid flag, a cache path that is a file)",
        INTERRUPTED: "interrupted (SIGINT, Ctrl-C)",
    },
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


def epilog(command: str | None = None) -> str:
    """The table for ``--help`` (a command's: only its own statuses), wrapped to 80 columns."""
    lines = ["exit status:"]
    for code, text in (COMMAND_MEANINGS[command] if command else MEANINGS).items():
        lines += textwrap.wrap(text, 80, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    return "\n".join(lines)
