"""``bootstrap``: the parser of every command, and the one place their exit status is decided
(``bootstrap.cli.exits``). The console script is ``bootstrap.cli.entry``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from bootstrap.cli.args import HelpFormatter
from bootstrap.cli.cache import add_cache_args, main_cache
from bootstrap.cli.exits import BAD_INPUT, BAD_INPUT_ERRORS, INTERRUPTED, epilog
from bootstrap.cli.plan import add_plan_args, main_plan
from bootstrap.cli.run import add_run_args, main_run
from bootstrap.cli.serve import add_serve_args, main_serve
from bootstrap.cli.trace.command import add_trace_args, main_trace
from bootstrap.pipeline.process import ProcessTimeline

if TYPE_CHECKING:
    from bootstrap.serve.startup.spawn import EngineSpawn

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Command]] = {
    "plan": ("run every stage on a simulated GPU and print the KV plan (no torch needed)", add_plan_args, main_plan),
    "run": ("build the real executor through the stages and answer one prompt", add_run_args, main_run),
    "serve": ("an OpenAI-compatible server; the port opens while the stages run", add_serve_args, main_serve),
    "trace": ("draw the stages and attempts of --trace-file files as timelines", add_trace_args, main_trace),
    "cache": ("list or clear the plan and model caches, with their sizes", add_cache_args, main_cache),
}


class Parser(argparse.ArgumentParser):
    """argparse, with a refused flag as one line (``bootstrap run: error: ...; see --help``)
    instead of the usage block and then the error: every refusal of every command is one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="bootstrap",
        formatter_class=HelpFormatter,
        epilog=epilog(),
        description="LLM executor creation as an async pipeline of traced, retryable stages.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=text, description=text, epilog=epilog(name), formatter_class=HelpFormatter))
    return parser


def main(
    argv: list[str] | None = None, process: ProcessTimeline | None = None, early_engine: EngineSpawn | None = None
) -> int:
    """Run the command ``argv`` names; its exit status. ``process``: the timeline its trace
    starts from (the console script's starts at the spawn; default: now). ``early_engine``: the
    engine's process ``bootstrap.cli.entry`` started for ``serve`` (the command stops one it
    does not take)."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # no command: what there is to run
        parser.print_help(sys.stderr)
        return BAD_INPUT
    args = parser.parse_args(argv)  # a bad flag: one line, exit status 2
    args.process = process or ProcessTimeline.from_now()
    args.early_engine = early_engine
    try:
        return COMMANDS[args.command][2](args)
    except BAD_INPUT_ERRORS as exc:  # what a command did not answer itself
        print(f"bootstrap: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print("bootstrap: interrupted", file=sys.stderr)  # plan and run, with stages, say so themselves
        return INTERRUPTED
