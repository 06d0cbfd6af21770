"""The bootstrap behind the server: built in the background while the port already answers.

``run_bootstrap`` has the engine's process make the backend and its ``Bootstrap``
(``remote``; with ``--engine-in-process`` both are made here, off the event loop: that imports
torch), runs the stages, and moves the state to ``ready`` or ``failed``; ``retry`` resumes a
failed run from its failed stage, keeping every earlier artifact (the weights stay loaded).
Cancelling either (a signal during the bootstrap) makes the pipeline roll every stage back. An
engine's process that exits unasked ends the server (``engine_died``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVarTuple

import anyio

from bootstrap.api.factory import load_backend_factory
from bootstrap.backends.base import Executor
from bootstrap.pipeline import StageFailed, failure_paragraph
from bootstrap.serve.state import ServeState

log = logging.getLogger("bootstrap.serve")
Ts = TypeVarTuple("Ts")


def make_bootstrap(state: ServeState) -> None:
    """``state.boot``, this server's ``Bootstrap`` (blocking: imports torch; run it in a thread).
    Set here, not returned, so a cancel that lands as the thread ends cannot lose it."""
    from bootstrap.api import Bootstrap

    with state.process.phase("backend") if state.process is not None else contextlib.nullcontext():
        backend = (state.make_backend or load_backend_factory(state.options.backend_factory))(state.config)
        importlib.import_module("bootstrap.engine.executor.channel.local")  # the channel's zmq, with the engine
    state.boot = Bootstrap(
        state.config,
        backend=backend,
        trace_file=state.options.trace_file,
        otlp=state.options.otlp,
        process=state.process,
        traces_requests=True,
        ranks=state.ranks,
    )


async def start_engine_process(state: ServeState, on_fatal: Callable[[], None]) -> None:
    """``state.boot``, a ``RemoteBootstrap``: the engine's process started and its backend made
    there (the ``backend`` phase: torch imported beside this process's start)."""
    with state.process.phase("backend") if state.process is not None else contextlib.nullcontext():
        await anyio.to_thread.run_sync(importlib.import_module, "bootstrap.serve.startup.remote")  # zmq, msgspec
        from bootstrap.serve.startup.remote import RemoteBootstrap

        boot = await RemoteBootstrap.start(state.config, state.options, state.process, state.engine_spawn)
    boot.on_death = lambda text: engine_died(state, text, on_fatal)
    state.boot = boot


def engine_died(state: ServeState, text: str, on_fatal: Callable[[], None]) -> None:
    """The engine's process is gone: its requests end with an error, the server stops (exit 1)."""
    from bootstrap.serve.startup.remote import EngineDied

    log.error("bootstrap serve: %s", text)
    state.serve_executor(None, error=f"generation stopped: {text}")
    state.fatal = EngineDied(text)
    state.set_phase("failed", text)
    on_fatal()


async def guarded(state: ServeState, build: Callable[[ServeState, *Ts], Awaitable[None]], *args: *Ts) -> None:
    """Run a build under ``state.build_scope``, which a shutdown cancels."""
    with anyio.CancelScope() as scope:
        state.build_scope = scope
        await build(state, *args)


async def run_bootstrap(state: ServeState, task_group: anyio.abc.TaskGroup, on_fatal: Callable[[], None]) -> None:
    """Build the executor; on a start that cannot even begin, ``on_fatal`` stops the server.
    The phase is ``starting`` while the engine is imported, then ``bootstrapping``."""
    try:
        if state.options.engine_process:
            await start_engine_process(state, on_fatal)
        else:
            await anyio.to_thread.run_sync(make_bootstrap, state)
    except Exception as exc:
        state.fatal = exc
        reason = f"cannot start the bootstrap: {type(exc).__name__}: {exc}"
        state.set_phase("failed", reason)
        log.error("bootstrap serve: %s", reason)  # not state.error: a shutdown in progress keeps its phase
        on_fatal()
        return
    task_group.start_soon(follow_progress, state)
    if state.options.idle:  # serve --idle: a swap gives it a model (and its id)
        state.model_id = ""
        state.set_phase("idle")
        log.info("idle: no model until POST /v1/bootstrap/swap")
        return
    state.set_phase("bootstrapping")
    await _settle(state, state.boot.build)


def start_retry(state: ServeState, task_group: anyio.abc.TaskGroup) -> str:
    """Resume the failed bootstrap from its failed stage, in the background; returns that stage.
    The phase changes at once, so a second retry meanwhile is refused."""
    stage = state.failure.stage
    state.failure = None
    state.set_phase("bootstrapping")
    task_group.start_soon(guarded, state, _retry)
    return stage


async def _retry(state: ServeState) -> None:
    await _settle(state, state.boot.retry)


async def _settle(state: ServeState, build: Callable[[], Awaitable[Executor | None]]) -> None:
    try:
        executor = await build()
    except anyio.get_cancelled_exc_class():
        log.warning("bootstrap cancelled; completed stages were rolled back")
        raise
    except StageFailed as exc:
        state.failure = exc
        paragraph = failure_paragraph(exc)
        state.set_phase("failed", paragraph)
        log.error("%s (POST /v1/bootstrap/retry resumes from %s)", paragraph, exc.stage)
        return
    except Exception as exc:  # not a stage failure: nothing to resume from
        state.set_phase("failed", f"{type(exc).__name__}: {exc}")
        log.exception("bootstrap failed")
        return
    if executor is None:  # a resumed sleep: asleep now
        state.set_phase("asleep")
        return
    report = state.boot.report()
    # not checked here: ``bootstrap serve`` takes the native backend only (``bootstrap.cli.serve``), and a
    # ``--backend-factory`` backend is trusted to start a ``PyExecutor``
    state.serve_executor(executor)
    state.max_seq_len = report.plan["max_seq_len"]
    state.time_to_ready_s = round(state.elapsed_s(), 6)
    state.set_phase("ready", since_ns=getattr(state.boot, "ready_ns", None))  # the engine's process: its end there
    since = (
        f" ({(time.time_ns() - state.process.spawn_ns) / 1e9:.2f} s after the process started)" if state.process else ""
    )
    log.info(
        "ready in %.2f s%s: KV %s tokens, max_seq_len %s",
        state.time_to_ready_s,
        since,
        report.plan.get("kv_tokens"),
        state.max_seq_len,
    )


async def follow_progress(state: ServeState) -> None:
    """Log each stage event and wake what waits on the state (``/v1/bootstrap/events``)."""
    async for event in state.boot.events():
        detail = f": {event.message}" if event.message else ""
        log.info("stage %-18s %s%s", event.stage, event.kind, detail)
        state.changes.notify()
