"""One live operation for the server: checked, run in the app's task group (a client that
hangs up does not cancel it), the phase moved as it goes, its outcome the route's answer.

While the operation checks what it was given the old model serves; the drain then moves the
phase (new requests get 503 naming the operation), lets requests in flight finish for
``--drain-timeout`` and cancels the rest (they end with ``abort`` and their partial output).
A swap whose new model cannot be read after that serves the old one again (400, ``Reverted``).
A shutdown cancels the operation (``state.build_scope``); its stages roll back.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from typing_extensions import TypedDict  # pydantic reads it on Python < 3.12 (the route's response model)

from bootstrap.api import Busy, Refused, Reverted
from bootstrap.api.operation_terms import VERBS, running
from bootstrap.backends.base import Executor
from bootstrap.config import ConfigError
from bootstrap.pipeline import StageFailed, failure_paragraph
from bootstrap.pipeline.runner import cause_chain
from bootstrap.serve.errors import APIError
from bootstrap.serve.openai.jobs import CANCEL_WAIT_S
from bootstrap.serve.state import OPERATING, ServeState

log = logging.getLogger("bootstrap.serve")
Call = Callable[[Callable[[], Awaitable[None]]], Awaitable[Executor | None]]
MAX_MESSAGE = 300  # characters of an error a client gets; the server's log has all of it
ALLOWED_FROM = {  # the phases each operation starts from
    "swap": ("ready", "failed", "idle", "asleep"),
    "weights": ("ready",),
    "sleep": ("ready",),
    "wake": ("asleep",),
}


class OperationAnswer(TypedDict):
    """A live operation's 200: what it did, the server's state after it, its stages and plan."""

    operation: str
    state: str
    model: str
    duration_s: float | None
    drain_s: float | None
    release_s: float | None
    stages: list[dict[str, object]]
    plan: dict[str, object]
    cut_short: int  # requests the drain cut short


@dataclass
class Outcome:
    """How ``_run`` ended: its answer, or the error the route raises."""

    answer: OperationAnswer | None = None
    error: APIError | None = None


def check_allowed(state: ServeState, name: str) -> None:
    """409 unless ``name`` may start now: nothing else runs and the phase allows it."""
    busy = state.boot.busy if state.boot is not None else None
    if busy is not None or state.phase not in ALLOWED_FROM[name]:
        doing = f"the {running(busy)} is running" if busy is not None else f"the server is {state.phase}"
        allowed, verb = ", ".join(ALLOWED_FROM[name]), VERBS.get(name, name)
        raise APIError(
            409, f"cannot {verb} now: {doing} (a {running(name)} starts from: {allowed})", code="operation_conflict"
        )


async def run_operation(
    state: ServeState, tasks: anyio.abc.TaskGroup, name: str, call: Call, param: str
) -> OperationAnswer:
    """Run ``call(drain)`` as operation ``name``; its answer (200), or the ``APIError`` of a
    refusal (400, naming ``param``), a conflict (409), a failure (500, retryable)."""
    check_allowed(state, name)
    outcome = Outcome()
    done = anyio.Event()
    tasks.start_soon(_run, state, name, call, param, outcome, done)
    await done.wait()
    if outcome.error is not None:
        raise outcome.error
    assert outcome.answer is not None  # _run sets one of the two
    return outcome.answer


async def _run(state: ServeState, name: str, call: Call, param: str, outcome: Outcome, done: anyio.Event) -> None:
    before, model_id = state.phase, state.model_id
    try:
        with anyio.CancelScope() as scope:
            state.build_scope = scope
            if name == "wake":
                state.set_phase("waking")
            cut: list[int] = []  # the requests the drain cut short
            executor = await call(lambda: drain(state, OPERATING[name], cut))
            settle(state, executor)
            outcome.answer = answer(state, name, sum(cut))
        if scope.cancelled_caught:
            outcome.error = APIError(
                503, f"the {name} was cancelled: the server is shutting down", code="shutting_down"
            )
    except Reverted as exc:  # after the drain: the old model was loaded again and serves
        state.model_id = model_id
        settle(state, state.boot.executor if state.boot is not None else None)
        log.warning("%s: %s", name, exc)
        outcome.error = APIError(400, client_text(exc), param=param, code="operation_reverted")
    except (Refused, ConfigError) as exc:
        state.set_phase(before, state.error)  # a refusal comes before the drain: nothing changed
        log.warning("%s refused: %s", name, exc)
        outcome.error = APIError(400, client_text(exc), param=param, code="operation_refused")
    except Busy as exc:
        outcome.error = APIError(409, str(exc), code="operation_conflict")
    except StageFailed as exc:
        state.failure = exc
        state.serve_executor(None)
        paragraph = failure_paragraph(exc)
        state.set_phase("failed", paragraph)
        log.error("%s: %s (POST /v1/bootstrap/retry resumes from %s)", name, paragraph, exc.stage)
        said = f"{client_text(exc, paragraph)}; POST /v1/bootstrap/retry resumes it"
        outcome.error = APIError(500, said, code="operation_failed")
    except Exception as exc:  # not a stage's failure: the state is what the operation left
        log.exception("%s failed", name)
        state.serve_executor(state.boot.executor if state.boot is not None else None)
        state.set_phase("failed" if state.executor is None else "ready", f"{type(exc).__name__}: {exc}")
        said = client_text(exc, f"the {name} failed: {type(exc).__name__}: {exc}")
        outcome.error = APIError(500, said, code="operation_failed")
    finally:
        done.set()


def client_text(exc: BaseException, text: str | None = None) -> str:
    """``text`` (default: what ``exc`` says) as a client gets it: what an exception from outside
    this package says while reading a file the client named (a library quoting the file's
    content) left out, on one line of at most ``MAX_MESSAGE`` characters. The log has it all."""
    text = str(exc) if text is None else text
    for inner in cause_chain(exc):
        said = str(inner).strip()
        if said and not type(inner).__module__.startswith("bootstrap."):
            text = text.replace(said, "(what it said: in the server's log)")
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 36] + "... (the rest in the server's log)"


async def drain(state: ServeState, phase: str, cut: list[int]) -> None:
    """New requests refused from here on; those in flight finish, or are cut short after
    ``drain_timeout_s`` (each then ends by itself with its partial output; counted in ``cut``)."""
    state.set_phase(phase)  # type: ignore[arg-type]
    with anyio.move_on_after(state.options.drain_timeout_s):
        await state.inflight.wait_idle()
    if len(state.inflight):
        log.warning(
            "%s: cancelling %d request(s) still running after %.1f s",
            phase,
            len(state.inflight),
            state.options.drain_timeout_s,
        )
        cut.append(state.cut_short())
        with anyio.move_on_after(CANCEL_WAIT_S):
            await state.inflight.wait_idle()
    state.serve_executor(None)


def settle(state: ServeState, executor: Executor | None) -> None:
    """The state after a successful operation (or a resumed one): serving, or asleep."""
    boot = state.boot
    state.failure = None
    if executor is None and boot is not None and boot.asleep:
        state.serve_executor(None)
        state.set_phase("asleep")
        return
    state.serve_executor(executor)
    state.max_seq_len = boot.report().plan.get("max_seq_len") if boot is not None else None
    state.set_phase("ready")


def answer(state: ServeState, name: str, cut_short: int = 0) -> OperationAnswer:
    record = state.boot.operations[-1]
    report = state.boot.report()
    return {
        "operation": name,
        "state": state.phase,
        "model": state.model_id,
        "duration_s": record.duration_s,
        "drain_s": record.drain_s,
        "release_s": record.release_s,
        "stages": report.stages,
        "plan": report.plan,
        "cut_short": cut_short,
    }
