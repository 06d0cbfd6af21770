"""Probes and the bootstrap's state: ``/health``, ``/ready``, ``/v1/bootstrap`` (+ ``/events``,
``/retry``) and ``/metrics``. None of them waits on the executor or on torch work."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bootstrap.serve.auth import operations_allowed
from bootstrap.serve.errors import APIError
from bootstrap.serve.openai.readiness import RETRY_AFTER_S
from bootstrap.serve.openai.render import SSE_HEADERS, sse
from bootstrap.serve.startup import task as build_task
from bootstrap.serve.startup.progress import bootstrap_view, ready_view
from bootstrap.serve.state import ServeState

log = logging.getLogger("bootstrap.serve")

SETTLED = ("ready", "failed", "shutting_down", "idle", "asleep")

router = APIRouter()


def _state(request: Request) -> ServeState:
    return request.app.state.serve


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the process lives (whatever the bootstrap does) and its engine answers; 503
    naming the engine once requests have waited on it ``--engine-timeout`` seconds with no step
    answering (logged the first time it is seen)."""
    state = _state(request)
    stall = state.engine_stall()
    if stall is None:
        state.stall_logged = False
        return JSONResponse({"status": "ok"})
    if not state.stall_logged:
        state.stall_logged = True
        log.error("/health: %s", stall)
    return JSONResponse({"status": "engine_stalled", "message": stall}, status_code=503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once the executor is ready; until then 503 with the stage and elapsed seconds."""
    state = _state(request)
    if state.phase == "ready":
        return JSONResponse(ready_view(state))
    headers = {"Retry-After": str(RETRY_AFTER_S.get(state.phase, 1))}
    return JSONResponse(ready_view(state), status_code=503, headers=headers)


@router.get("/v1/bootstrap")
async def bootstrap_state(request: Request) -> dict[str, Any]:
    return bootstrap_view(_state(request))


@router.get("/v1/bootstrap/events")
async def bootstrap_events(request: Request) -> StreamingResponse:
    """Every stage event so far, then new ones as they come (``event: stage``); the stream ends
    with one ``event: ready``, ``failed`` or ``shutting_down`` carrying the ``/ready`` body."""
    return StreamingResponse(_progress(_state(request)), media_type="text/event-stream", headers=SSE_HEADERS)


async def _progress(state: ServeState) -> AsyncIterator[str]:
    cursor = 0
    while True:
        change = state.changes.next()  # taken before reading: a change after the read wakes us
        events, cursor = state.stage_events_since(cursor)
        for event in events:
            yield sse(dataclasses.asdict(event), event="stage")
        if state.phase in SETTLED:
            yield sse(ready_view(state), event=state.phase)
            return
        await change.wait()


@router.post("/v1/bootstrap/retry", status_code=202, dependencies=[Depends(operations_allowed)])
async def retry(request: Request) -> dict[str, Any]:
    """Resume a failed bootstrap from its failed stage (earlier artifacts, weights included, are
    kept); 409 when nothing failed or the failure cannot be resumed."""
    state = _state(request)
    if state.phase != "failed" or state.failure is None:
        why = "it failed before any stage ran" if state.phase == "failed" else f"the server is {state.phase}"
        raise APIError(409, f"nothing to retry: {why}", code="nothing_to_retry")
    stage = build_task.start_retry(state, request.app.state.tasks)
    return {"state": state.phase, "resumed_from": stage}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
