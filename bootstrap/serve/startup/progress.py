"""The bootstrap as the probes show it: one row per stage, the current stage, the plan.

Read from the pipeline's status table and event history, on the event loop (where both are
written), so a row is never half-updated.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypedDict

from bootstrap.serve.state import ServeState
from bootstrap.stages import STAGE_IDS

if TYPE_CHECKING:
    from bootstrap.pipeline.events import StageStatus

RETRYING = ("attempt_failed", "retrying")


class StageRow(TypedDict):
    """One stage as ``GET /v1/bootstrap`` shows it (``stage_rows``)."""

    id: str
    state: str  # the stage's state, or "retrying"
    attempts: int
    duration_s: float | None
    error: str | None
    last_attempt_error: str | None
    retry_change: str | None
    skip_reason: str | None
    figures: dict[str, int | float | str]


def stage_rows(state: ServeState) -> list[StageRow]:
    """``id``, ``state`` (pending, running, retrying, done, skipped, failed, cancelled),
    ``attempts``, ``duration_s`` (so far while it runs), ``error``, ``skip_reason``, and while
    retrying the error of the attempt that failed and what the retry changes."""
    if state.boot is None:  # the engine is still being imported: the stages it will run, none begun
        return [_pending(stage) for stage in STAGE_IDS]
    history = state.stage_history()
    last = {event.stage: event for event in history}
    attempt_errors = {e.stage: e.message for e in history if e.kind == "attempt_failed"}
    retry_notes = {e.stage: e.message for e in history if e.kind == "retrying"}
    rows: list[StageRow] = []
    for status in state.boot.stage_status():
        event = last.get(status.stage)
        retrying = status.state == "running" and event is not None and event.kind in RETRYING
        shown = "retrying" if retrying else status.state
        rows.append(
            {
                "id": status.stage,
                "state": shown,
                "attempts": status.attempts,
                "duration_s": _duration(status),
                "error": status.error if status.state in ("failed", "cancelled") else None,
                "last_attempt_error": attempt_errors.get(status.stage) if shown == "retrying" else None,
                "retry_change": retry_notes.get(status.stage) if shown == "retrying" else None,
                "skip_reason": event.message if status.state == "skipped" and event is not None else None,
                "figures": dict(status.figures),
            }
        )
    return rows


def _pending(stage: str) -> StageRow:
    return {
        "id": stage,
        "state": "pending",
        "attempts": 0,
        "duration_s": None,
        "error": None,
        "last_attempt_error": None,
        "retry_change": None,
        "skip_reason": None,
        "figures": {},
    }


def _duration(status: StageStatus) -> float | None:
    if status.state == "running" and status.started_at is not None:
        return round(time.time() - status.started_at, 6)
    return None if status.duration_s is None else round(status.duration_s, 6)


def current_stage(rows: list[StageRow]) -> StageRow | None:
    """The stage running now, else the one that failed, else None."""
    for wanted in (("running", "retrying"), ("failed",)):
        row = next((r for r in rows if r["state"] in wanted), None)
        if row is not None:
            return row
    return None


def bootstrap_view(state: ServeState) -> dict[str, Any]:
    """``GET /v1/bootstrap``: phase, stages, the plan once known, and the failure if any."""
    rows = stage_rows(state)
    stage = current_stage(rows)
    return {
        "state": state.phase,
        "model": state.model_id or None,
        "elapsed_s": round(state.elapsed_s(), 6),
        "time_to_ready_s": state.time_to_ready_s,
        "current_stage": stage["id"] if stage else None,
        "error": state.error,
        "retryable": state.failure is not None and state.phase == "failed",
        "stages": rows,
        "plan": state.boot.plan() if state.boot is not None else {},
        "asleep": state.boot.asleep if state.boot is not None else 0,
        "operations": [r.to_dict() for r in state.boot.operations] if state.boot is not None else [],
    }


def ready_view(state: ServeState) -> dict[str, Any]:
    """``GET /ready``: ready or not, the stage it is at, and for how long; ``ranks``: how many
    run it (``--tp N``: every rank is at this stage, their attempts end agreed)."""
    stage = current_stage(stage_rows(state))
    return {
        "ready": state.phase == "ready",
        "state": state.phase,
        "stage": stage["id"] if stage else None,
        "stage_state": stage["state"] if stage else None,
        "stage_elapsed_s": stage["duration_s"] if stage else None,
        "elapsed_s": round(state.elapsed_s(), 6),
        "time_to_ready_s": state.time_to_ready_s,
        "error": state.error,
        "ranks": state.config.tensor_parallel_size,
    }
