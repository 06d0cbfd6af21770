"""Whether a generation request may reach the executor now, and the 503 it gets when not."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bootstrap.serve.errors import APIError
from bootstrap.serve.state import ServeState

if TYPE_CHECKING:
    from bootstrap.engine.executor.channel.client import EngineClient  # zmq: with the first executor

RETRY_AFTER_S = {"starting": 1, "bootstrapping": 1, "failed": 5, "shutting_down": 5, "idle": 5, "asleep": 5}
OPERATION_OF = {"swapping": "swap", "updating_weights": "weights update", "sleeping": "sleep", "waking": "wake"}


NOT_SERVING = {  # phase -> (code, message) of the 503 a request gets then
    "shutting_down": ("shutting_down", "the server is shutting down"),
    "idle": ("idle", "no model is loaded (serve --idle); POST /v1/bootstrap/swap gives the server one"),
    "asleep": ("asleep", "the model is asleep; POST /v1/bootstrap/wake wakes it"),
} | {
    phase: ("operation_in_progress", f"a {what} is in progress; retry after it (see GET /v1/bootstrap)")
    for phase, what in OPERATION_OF.items()
}


def ready_executor(state: ServeState) -> EngineClient:
    """The executor, or 503 with ``Retry-After`` and what the bootstrap is doing."""
    if state.phase == "ready" and state.executor is not None:
        return state.executor
    if state.phase == "failed":
        code, message = (
            "bootstrap_failed",
            f"the bootstrap failed: {state.error}; see GET /v1/bootstrap, POST /v1/bootstrap/retry",
        )
    else:
        code, message = NOT_SERVING.get(
            state.phase,
            ("not_ready", "the executor is not ready yet (bootstrap in progress; see GET /ready or /v1/bootstrap)"),
        )
    raise APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S.get(state.phase, 1))})
