"""``bootstrap run``: build the real executor through the stages, then answer one prompt.

Progress goes to stderr while the stages run; then the stage table, the plan line, and the
generated text streamed as it comes (or, with ``--json``, one object on stdout).
``bootstrap cache clear`` empties the plan cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console

from bootstrap.config import ConfigError
from bootstrap.events import StageEvent
from bootstrap.pipeline import StageFailed
from bootstrap.report import stage_table

DEFAULT_PLAN_CACHE = Path.home() / ".cache" / "executor-bootstrap" / "plans"
DEFAULT_MAX_TOKENS = 64
DEFAULT_QUESTION = "What is the capital of France?"


def add_run_args(run: argparse.ArgumentParser) -> None:
    add = run.add_argument
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    text = run.add_mutually_exclusive_group()
    text.add_argument("--prompt", help="plain text prompt")
    text.add_argument("--chat", help="one user message, formatted with the tokenizer's chat template")
    add("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate (>= 1)")
    add("--temperature", type=float, default=0.0, help="0 for greedy")
    add("--seed", type=int, help="sampling seed")
    add("--trace-file", type=Path, help="write finished spans as JSON Lines (overwrites the file)")
    add("--otlp", action="store_true", help="also export spans over OTLP (needs the otlp extra)")
    add("--json", action="store_true", help="print one JSON object instead of tables and text")
    add("--no-plan-cache", action="store_true", help=f"profile every start (default cache: {DEFAULT_PLAN_CACHE})")
    add("--dist-timeout", type=float, default=600.0,
        help="with --tp N: seconds any collective waits for a rank before it names the rank that stopped answering")  # fmt: skip


def add_cache_args(cache: argparse.ArgumentParser) -> None:
    cache.add_argument("action", choices=["clear"], help="clear: delete every cached plan")
    cache.add_argument("--plan-cache", type=Path, default=DEFAULT_PLAN_CACHE, help="the cache directory")


def clear_cache(args: argparse.Namespace) -> int:
    directory = args.plan_cache.expanduser()
    count = len(list(directory.glob("*.json"))) if directory.is_dir() else 0
    shutil.rmtree(directory, ignore_errors=True)
    print(f"removed {count} cached plan(s) from {directory}")
    return 0


def sampling_params(args: argparse.Namespace) -> Any:
    from bootstrap.engine.sampling import SamplingParams

    if args.max_tokens < 1:
        raise ConfigError(f"max_tokens: must be >= 1 (got {args.max_tokens})")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)


def prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    """The prompt as token ids. Neither ``--prompt`` nor ``--chat``: the default question, as a
    chat where the tokenizer has a template; a model without a tokenizer gets one token."""
    if tokenizer is None:
        if args.prompt or args.chat:
            raise ConfigError("prompt: this model has no tokenizer (random weights); leave --prompt and --chat out")
        return [0]
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if args.chat is not None and not has_template:
        raise ConfigError("chat: this model's tokenizer has no chat template; use --prompt")
    if args.prompt is None and has_template:
        chat = [{"role": "user", "content": args.chat or DEFAULT_QUESTION}]
        return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    return list(tokenizer(args.prompt or DEFAULT_QUESTION)["input_ids"])


def check_length(ids: list[int], max_tokens: int, max_seq_len: int) -> None:
    if len(ids) + max_tokens > max_seq_len:
        raise ConfigError(
            f"prompt: {len(ids)} prompt tokens + max_tokens {max_tokens} = {len(ids) + max_tokens} exceeds "
            f"max_seq_len {max_seq_len}; shorten the prompt, lower --max-tokens or raise --max-seq-len"
        )


async def run_command(args: argparse.Namespace, config: Any, backend: Any = None) -> tuple[dict[str, Any], Exception | None]:
    """Build, answer, release; returns the ``--json`` object and the failure, if any: a
    ``StageFailed``, or a ``ConfigError`` for a prompt the ready executor cannot take."""
    from bootstrap.api import Bootstrap

    params = sampling_params(args)
    quiet = rank_of(args) > 0  # several ranks: rank 0 speaks for all of them
    boot = Bootstrap(config, backend=backend, trace_file=None if quiet else args.trace_file, otlp=args.otlp)
    progress = None if args.json or quiet else Console(stderr=True)
    result: dict[str, Any] = {"text": "", "token_ids": []}
    shown = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            if progress is not None:
                tg.start_soon(show_progress, boot.events(), progress, shown)
            try:
                executor = await boot.build()
            except StageFailed as exc:
                return {**result, **boot.report().to_dict(), "error": failure_line(exc)}, exc
            finally:
                with anyio.move_on_after(1.0):  # let the last lines print, never wait for long
                    await shown.wait() if progress is not None else None
                tg.cancel_scope.cancel()
        report = boot.report()
        if progress is not None:
            print_ready(report, Console())  # quiet ranks have no progress either
        try:
            result.update(await generate(args, executor, params, report.plan["max_seq_len"]))
        except ConfigError as exc:
            return {**result, **report.to_dict(), "error": str(exc)}, exc
        return {**result, **report.to_dict(), "error": None}, None
    finally:
        await boot.aclose()


async def generate(args: argparse.Namespace, executor: Any, params: Any, max_seq_len: int) -> dict[str, Any]:
    ids = prompt_ids(args, executor.tokenizer)
    check_length(ids, params.max_tokens, max_seq_len)
    rid = executor.enqueue(ids, params)
    tokens, text = [], []
    async for event in executor.stream_async(rid):
        if event.token_id is not None:
            tokens.append(event.token_id)
        text.append(event.text)
        if not args.json and rank_of(args) == 0:
            print(event.text, end="", flush=True)
        if event.finished and event.error:
            raise RuntimeError(f"generation failed: {event.error}")
    if not args.json and rank_of(args) == 0:
        print()
    return {"text": "".join(text), "token_ids": tokens, "finish_reason": event.finish_reason}


async def show_progress(events: Any, console: Console, shown: anyio.Event) -> None:
    """One line per stage event while the stages run (the server shows the same stream);
    ``shown`` is set once the last stage ended or any stage failed."""
    from bootstrap.stages import STAGE_IDS

    marks = {"done": "[green]done[/]", "skipped": "[cyan]skipped[/]", "failed": "[red]failed[/]",
             "attempt_failed": "[yellow]attempt failed[/]", "retrying": "[yellow]retrying[/]"}  # fmt: skip
    async for event in events:
        if event.kind in marks:
            console.print(f"  {event.stage:<18} {marks[event.kind]} {describe(event)}", highlight=False)
        elif event.kind == "started":
            console.print(f"  {event.stage:<18} started", style="dim", highlight=False)
        if event.kind == "failed" or (event.stage == STAGE_IDS[-1] and event.kind in ("done", "skipped")):
            shown.set()


def describe(event: StageEvent) -> str:
    return event.message[:160] if event.kind != "done" else ""


def print_ready(report: Any, console: Console) -> None:
    from bootstrap.cli import plan_line

    console.print(stage_table(report.stages, title=f"ready in {report.time_to_ready_s:.2f} s"))
    console.print(plan_line(report.plan), highlight=False)


def failure_line(exc: StageFailed) -> str:
    tries = "attempt" if exc.attempts == 1 else "attempts"
    text = f"bootstrap failed at stage {exc.stage!r} after {exc.attempts} {tries}: {exc.cause}"
    return f"{text}. {exc.advice}" if exc.advice else text


def rank_of(args: argparse.Namespace) -> int:
    """This process's rank when it is one of several (``bootstrap.cli_tp``), else 0."""
    return getattr(args, "rank", 0)


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    if result.get("error"):
        print(f"bootstrap: {result['error']}", file=sys.stderr)
