"""``bootstrap run``: build the real executor through the stages, then answer one prompt.

Progress goes to stderr while the stages run; then the stage table, the plan line, and the
generated text streamed as it comes (or, with ``--json``, one object on stdout). ``--tp N``
starts N ranks first (``bootstrap.cli.tp``).

Stage messages, paths and library errors are printed verbatim: the consoles here never read rich
markup (``plain_console``), and the progress marks are styled ``Text``, so ``odd[/llama]`` or
``[enforce fail at alloc_cpu.cpp:127]`` reach the terminal as written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from typing import Any

import anyio
from rich.console import Console
from rich.text import Text

from bootstrap.api import require_engine
from bootstrap.backends.base import RequestExecutor, Speculates, require_requests
from bootstrap.cli.args import (
    add_build_args,
    add_config_args,
    check_kv_tokens,
    check_model_limits,
    check_run_values,
    config_from_args,
)
from bootstrap.cli.exits import BAD_INPUT, BAD_INPUT_ERRORS, INTERRUPTED, exit_status
from bootstrap.cli.plan import plan_line, print_retries, print_wrapped
from bootstrap.cli.stage_waits import StageWaits, in_flight
from bootstrap.cli.stops import HeldStops, Stopped, held_stops, stop_name, until_stopped
from bootstrap.cli.tp import (
    await_rank_0,
    check_rank_count,
    check_tp_before_launch,
    launch_ranks,
    leave,
    needs_launch,
    rank_backend,
    this_rank,
)
from bootstrap.config import BootstrapConfig
from bootstrap.engine.kernels import triton_start
from bootstrap.engine.request.prompts import (
    EMPTY_PROMPT,
    PromptError,
    chat_ids,
    checked_max_tokens,
    sampling_params,
    text_ids,
)
from bootstrap.pipeline import StageFailed, failure_paragraph
from bootstrap.pipeline.events import StageEvent
from bootstrap.pipeline.report import stage_table

DEFAULT_MAX_TOKENS = 64
DEFAULT_QUESTION = "What is the capital of France?"
MARKS = {
    "done": ("done", "green"),
    "skipped": ("skipped", "cyan"),
    "failed": ("failed", "red"),
    "attempt_failed": ("attempt failed", "yellow"),
    "retrying": ("retrying", "yellow"),
}


def add_run_args(run: argparse.ArgumentParser) -> None:
    add_config_args(run, "run")
    add_build_args(run)
    add = run.add_argument
    text = run.add_mutually_exclusive_group()
    text.add_argument("--prompt", help="plain text prompt (default: the question below, as a chat)")
    text.add_argument(
        "--chat", help=f"one user message, formatted with the tokenizer's chat template (default: {DEFAULT_QUESTION!r})"
    )
    add("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate, >= 1")
    add("--temperature", type=float, default=0.0, help="0 for greedy")
    add("--seed", type=int, help="sampling seed (default: none, a fresh one per run)")
    add("--json", action="store_true", help="print one JSON object instead of tables and text")


def main_run(args: argparse.Namespace) -> int:
    """One rank's run (or the only one); ``--tp N`` without a launcher starts N ranks of it.
    SIGTERM and SIGHUP are held throughout, and act only where a stop can roll back (``stops``)."""
    with held_stops() as held:
        try:
            return _main_run(args, held)
        finally:
            leave()


def _main_run(args: argparse.Namespace, held: HeldStops) -> int:
    try:
        with args.process.phase("checks"):
            config = _checked_config(args)
    except BAD_INPUT_ERRORS as exc:
        return _refused(args, str(exc), held)
    try:
        if not args.json and rank_of(args) == 0 and not getattr(args, "announced", False):
            announce(config, args)
        if needs_launch(config):
            return launch_ranks(args, config.tensor_parallel_size, main_run)
        triton_start.begin_for(config.device, config.backend, config.tensor_parallel_size)
        result, error = anyio.run(run_command, args, config, rank_backend(config, args), held)
    except BAD_INPUT_ERRORS as exc:
        return _ended_early(args, str(exc), BAD_INPUT)
    except Stopped as exc:
        return _ended_early(args, f"{stop_name(exc.signum)}; completed stages were rolled back", exc.status)
    except KeyboardInterrupt:
        return _ended_early(args, "interrupted; completed stages were rolled back", INTERRUPTED)
    if rank_of(args) == 0:
        emit(result, args.json)
    return exit_status(error)  # the same on every rank: the launcher may see rank 1's first


def _checked_config(args: argparse.Namespace) -> BootstrapConfig:
    """The config, refused before any work when a value is out of range; the same on every rank
    (each has the same arguments and launcher environment)."""
    config = config_from_args(args)
    check_run_values(args)
    if args.prompt == "":  # no tokens under any tokenizer without a BOS: the server refuses it too
        raise PromptError(EMPTY_PROMPT, field="prompt")
    check_kv_tokens(config)
    check_model_limits(config)
    check_rank_count(config)
    require_engine()
    if needs_launch(config):
        check_tp_before_launch(config)
    return config


def _refused(args: argparse.Namespace, message: str, held: HeldStops) -> int:
    """Bad input, found by the checks on every rank alike: rank 0 says so; a rank > 0 ends when
    the launcher stops it (``await_rank_0``)."""
    if rank_of(args) > 0 and (signum := await_rank_0(held)) is not None:
        return Stopped(signum).status
    return _ended_early(args, message, BAD_INPUT)


def _ended_early(args: argparse.Namespace, message: str, status: int) -> int:
    """Bad input or a stop before a result: rank 0 says so (one object under ``--json`` too)."""
    if rank_of(args) == 0:
        emit({"text": "", "token_ids": [], "stages": [], "plan": {}, "error": message}, args.json)
    return status


async def run_command(
    args: argparse.Namespace, config: BootstrapConfig, backend: Any = None, held: HeldStops | None = None
) -> tuple[dict[str, Any], Exception | None]:
    """Build, answer, release; returns the ``--json`` object and the failure, if any: a
    ``StageFailed``, a ``PromptError`` for a prompt the ready executor cannot take, or any error
    of the answer after ready (``answer_failed``): every failure is reported, none escapes."""
    from bootstrap.api import Bootstrap

    quiet = rank_of(args) > 0  # several ranks: rank 0 speaks for all of them
    stops = (held, not quiet) if held is not None else ()
    boot = Bootstrap(
        config, backend=backend, trace_file=None if quiet else args.trace_file, otlp=args.otlp, process=args.process
    )
    progress = None if args.json or quiet else plain_console(stderr=True)
    result: dict[str, Any] = {"text": "", "token_ids": []}
    with engine_log_lines(quiet):  # the engine's warnings until it is released: one line each, none on quiet ranks
        try:
            executor, failure = await _build(boot, progress, stops)
            if failure is not None:
                return {**result, **boot.report().to_dict(), "error": failure_paragraph(failure)}, failure
            report = boot.report()
            result["ready_after_spawn_s"] = round((time.time_ns() - args.process.spawn_ns) / 1e9, 3)
            try:
                with boot.phase("answer"):
                    if progress is not None:
                        # quiet ranks have no progress either
                        print_ready(report, plain_console(), result["ready_after_spawn_s"])
                    answer = await until_stopped(
                        lambda: generate(args, require_requests(executor), report.plan["max_seq_len"]),
                        lambda: "shutting the executor down",
                        *stops,
                    )
                result.update(answer)
            except BAD_INPUT_ERRORS as exc:
                return {**result, **report.to_dict(), "error": str(exc)}, exc
            except Exception as exc:
                return {**result, **report.to_dict(), "error": answer_failed(exc)}, exc
            return {**result, **report.to_dict(), "error": None}, None
        finally:
            await boot.aclose()


class OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"  engine: {record.getMessage()}"


@contextlib.contextmanager
def engine_log_lines(quiet: bool) -> Any:
    """The engine's warnings during the answer and the release, one line each on stderr (none on a
    quiet rank): a failed step logs its exception, which the error paragraph reports; unconfigured,
    logging would print its traceback too (a rank still stepping when the other was stopped)."""
    logger = logging.getLogger("bootstrap.engine")
    handler = logging.NullHandler() if quiet else logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(OneLine())
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


class GenerationFailed(RuntimeError):
    """The request ended with an error (its message, e.g. a failed step's ``RuntimeError: ...``)."""


def answer_failed(exc: Exception) -> str:
    """A failure of the answer after ready (a failed step, a rank that stopped answering, ...) as
    one paragraph: errors from torch or a collective carry newlines and indented detail."""
    detail = str(exc) if isinstance(exc, GenerationFailed) else f"{type(exc).__name__}: {exc}"
    return "the generation failed after the executor was ready: " + " ".join(detail.split())


def announce(config: BootstrapConfig, args: argparse.Namespace) -> None:
    """The first line, before the engine's imports: what starts, on what, and where its trace goes."""
    trace = f"; trace: {args.trace_file}" if args.trace_file else ""
    tp = f" x{config.tensor_parallel_size} ranks" if config.tensor_parallel_size > 1 else ""
    print(
        f"bootstrap run: {config.model} on {config.device}{tp} ({config.backend} backend){trace}",
        file=sys.stderr,
        flush=True,
    )


def rolling_back(boot: Any) -> str:
    """What an interrupt during the build does: the running stages finish what is in flight (it
    cannot be cut short), then every stage rolls back."""
    running = [s.stage for s in boot.pipeline.status.values() if s.state == "running"]
    if not running:
        return "rolling back the completed stages"
    waits = " and ".join(dict.fromkeys(in_flight(stage) for stage in running))
    return f"rolling back {', '.join(running)} once {waits} is done (it cannot be cut short)"


async def _build(boot: Any, progress: Console | None, stops: tuple[Any, ...] = ()) -> tuple[Any, StageFailed | None]:
    """``boot.build()`` in a stop window (``until_stopped``), with one progress line per stage
    event meanwhile: the executor, or the stage failure. The last lines are flushed outside the
    window, so a stop that arrives once the failure is known is held and the failure is the
    report. Caught inside the task group and raised after it: never wrapped in an exception group."""
    shown, outcome = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        if progress is not None:
            tg.start_soon(show_progress, boot.events(), progress, shown)
        try:
            outcome.append((await until_stopped(boot.build, lambda: rolling_back(boot), *stops), None))
        except StageFailed as exc:
            outcome.append((None, exc))
        except Stopped as exc:
            outcome.append(exc)
        finally:
            with anyio.move_on_after(1.0):  # let the last lines print, never wait for long
                await shown.wait() if progress is not None else None
            tg.cancel_scope.cancel()
    if isinstance(outcome[0], Stopped):
        raise outcome[0]
    return outcome[0]


def prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    """The prompt as token ids. Neither ``--prompt`` nor ``--chat``: the default question, as a
    chat where the tokenizer has a template; a model without a tokenizer gets one token."""
    if tokenizer is None and args.prompt is None and args.chat is None:
        return [0]
    if args.chat is not None or (args.prompt is None and getattr(tokenizer, "chat_template", None)):
        question = DEFAULT_QUESTION if args.chat is None else args.chat
        return chat_ids(tokenizer, [{"role": "user", "content": question}], field="chat")
    return text_ids(tokenizer, DEFAULT_QUESTION if args.prompt is None else args.prompt)


async def generate(args: argparse.Namespace, executor: RequestExecutor, max_seq_len: int) -> dict[str, Any]:
    ids = prompt_ids(args, executor.tokenizer)
    max_tokens = checked_max_tokens(len(ids), args.max_tokens, max_seq_len)
    params = sampling_params(max_tokens, temperature=args.temperature, seed=args.seed)
    rid = executor.enqueue(ids, params)
    tokens, text = [], []
    speak = not args.json and rank_of(args) == 0
    async for event in executor.stream_async(rid):
        if event.token_id is not None:
            tokens.append(event.token_id)
        text.append(event.text)
        if speak:
            print(event.text, end="", flush=True)
        if event.finished and event.error:
            if speak:
                print()  # the paragraph on stderr starts on a line of its own
            raise GenerationFailed(event.error)
    if speak:
        print()
    speculator = executor.speculator if isinstance(executor, Speculates) else None  # the native executor's draft
    speculation = speculator.stats.to_dict() if speculator is not None else None
    return {
        "text": "".join(text),
        "token_ids": tokens,
        "finish_reason": event.finish_reason,
        "speculation": speculation,
    }


async def show_progress(events: Any, console: Console, shown: anyio.Event) -> None:
    """One line per stage event while the stages run (the server shows the same stream), and
    progress while one runs long (``StageWaits``); ``shown`` is set once the last stage ended or
    any stage failed."""
    from bootstrap.stages import STAGE_IDS

    failed_attempts: dict[str, StageEvent] = {}
    waits = StageWaits(console)
    async with anyio.create_task_group() as tg:
        tg.start_soon(waits.run)
        async for event in events:
            if event.kind in ("done", "skipped", "failed", "cancelled"):
                waits.ended(event.stage)
            if event.kind == "attempt_failed":  # shown with its retry; a failed stage's error is the final paragraph
                failed_attempts[event.stage] = event
            elif event.kind in MARKS:
                if event.kind == "retrying" and event.stage in failed_attempts:
                    console.print(progress_line(failed_attempts.pop(event.stage)), highlight=False, soft_wrap=True)
                failed_attempts.pop(event.stage, None)
                console.print(progress_line(event), highlight=False, soft_wrap=True)
            elif event.kind == "started":
                waits.started(event.stage)
                console.print(Text(f"  {event.stage:<18} started", style="dim"), highlight=False)
            if event.kind == "failed" or (event.stage == STAGE_IDS[-1] and event.kind in ("done", "skipped")):
                waits.stop()
                shown.set()
        tg.cancel_scope.cancel()


def progress_line(event: StageEvent) -> Text:
    """The stage, its coloured mark, and the message as plain text (never read as markup)."""
    text, style = MARKS[event.kind]
    message = describe(event)
    return Text.assemble(f"  {event.stage:<18} ", (text, style), f" {message}" if message else "")


def plain_console(stderr: bool = False) -> Console:
    """A console that prints strings as written: user and library text is never rich markup."""
    return Console(stderr=stderr, markup=False)


def describe(event: StageEvent) -> str:
    """The event's message, whole; none for ``done``, and none for ``failed``, whose error is the
    paragraph printed once at the end (``emit``)."""
    return event.message if event.kind not in ("done", "failed") else ""


def print_ready(report: Any, console: Console, after_spawn_s: float) -> None:
    """The stage table under the time a user waited (from the process's spawn) and the stages' share."""
    title = f"ready {after_spawn_s:.2f} s after the start (stages {report.time_to_ready_s:.2f} s)"
    console.print(stage_table(report.stages, title=title))
    print_retries(report.stages, console)
    print_wrapped(plan_line(report.plan), console)


def rank_of(args: argparse.Namespace) -> int:
    """This process's rank when it is one of several (``bootstrap.cli.tp``), else 0."""
    return this_rank()


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    if result.get("error"):  # a stage failure's paragraph begins "bootstrap failed at": one prefix
        print(f"bootstrap: {result['error'].removeprefix('bootstrap ')}", file=sys.stderr)
