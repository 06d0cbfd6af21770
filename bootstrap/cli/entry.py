"""The ``bootstrap`` console script, ``python -m bootstrap`` and ``python -m bootstrap.cli``.

It imports nothing of the command's before it reads the command line: ``bootstrap serve`` with
the engine in a process of its own (the default) starts that process here, about 0.1 s into the
command instead of after its imports (half a second on an H100 host), since the engine's import of
torch is the start's longest wait. The flags are only glanced at (``early_engine_flags``): the
parser still decides, and ``bootstrap.cli.serve`` stops a process started for flags it refuses or
for a server that keeps the engine inside (``--engine-in-process``, ``--tp N``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import NoReturn

from bootstrap.cli.first_moment import FIRST_MOMENT


class _Glance(argparse.ArgumentParser):
    """A parser that says nothing: a flag it cannot read is the real parser's to refuse."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def early_engine_flags(argv: list[str]) -> tuple[str, bool] | None:
    """The engine process's flags (log level, Triton's start begun ahead) for ``serve`` on one
    process with the engine in its own; None where it may not start one, or the flags do not
    parse (the parser says why, later)."""
    if not argv or argv[0] != "serve" or "RANK" in os.environ:  # a rank under a launcher: never its own engine
        return None
    glance = _Glance(add_help=False, allow_abbrev=False)
    glance.add_argument("-h", "--help", action="store_true")
    glance.add_argument("--tp", type=int, default=1)
    glance.add_argument("--engine-in-process", action="store_true")
    glance.add_argument("--backend-factory")
    glance.add_argument("--device", default="auto")
    glance.add_argument("--log-level", default="info")
    try:
        known, _ = glance.parse_known_args(argv[1:])
    except ValueError:  # a flag without its value, a --tp that is no integer: the parser's line, later
        return None
    if known.help or known.engine_in_process or known.tp != 1:
        return None
    from bootstrap.serve.startup.spawn import begins_triton

    return known.log_level, begins_triton(known.device, known.backend_factory)


def entry() -> NoReturn:
    """``bootstrap.cli.main.main`` with a trace that starts at the process's spawn. Once its
    output is flushed the process ends at once (``os._exit``): Python's own finalization, with
    torch imported, takes about a second and does nothing a finished command needs (the trace is
    flushed, the executor shut down, no thread outlives it)."""
    argv = sys.argv[1:]
    engine = None
    flags = early_engine_flags(argv)
    if flags is not None:
        from bootstrap.serve.startup.spawn import EngineSpawn

        engine = EngineSpawn(*flags)
    try:
        from bootstrap.cli.main import main
        from bootstrap.pipeline.process import ProcessTimeline, spawn_time_ns

        code = main(argv, process=ProcessTimeline(spawn_time_ns(FIRST_MOMENT)), early_engine=engine)
    finally:
        if engine is not None:  # idempotent: a no-op where the server stopped it, a kill where it never took it
            engine.kill()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe must not change the status
            stream.flush()
    logging.shutdown()
    os._exit(code)
