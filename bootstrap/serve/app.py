"""The app factory: routes, errors, key check, metrics, and the lifespan that owns the bootstrap.

With an API key, every route but ``/health``, ``/ready`` and ``/metrics`` needs it, the docs and
``/openapi.json`` included (``bootstrap.serve.auth``); the app logs that once, never the key.
It refuses other sites but ``--allowed-origins`` (on loopback, foreign ``Host`` names too) and
bodies not declared JSON (``content_type``); bound elsewhere without a key, it says so at start
and refuses the live operations unless ``--allow-open-operations``.

The lifespan starts the bootstrap in the background and returns at once, so the server binds
its port while the stages run. On shutdown (``state.begin_shutdown``, from a signal) the drain
task cancels a bootstrap in progress (the pipeline rolls back), lets requests in flight finish
for ``shutdown_timeout_s``, then cancels the rest in the executor, whose streams end with a
final chunk. When the server stops, everything is released: executor, KV pool, weights,
device thread, trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from bootstrap.serve.auth import OPEN, APIKeyMiddleware, SameSiteMiddleware, open_bind
from bootstrap.serve.body_limit import BodyLimitMiddleware
from bootstrap.serve.content_type import JsonBodyMiddleware
from bootstrap.serve.errors import ServerErrors, install_handlers
from bootstrap.serve.live import routes as live_routes
from bootstrap.serve.metrics import ServeMetrics
from bootstrap.serve.openai import routes as openai_routes
from bootstrap.serve.openai.bodies import document_bodies
from bootstrap.serve.request_trace import RequestTracing
from bootstrap.serve.startup import routes as startup_routes
from bootstrap.serve.startup import task as build_task
from bootstrap.serve.state import ServeState
from bootstrap.serve.status import routes as status_routes

log = logging.getLogger("bootstrap.serve")
CORS = {"allow_methods": ["*"], "allow_headers": ["*"]}  # for the origins --allowed-origins names


def create_app(state: ServeState, on_fatal: Callable[[], None] = lambda: None) -> FastAPI:
    """A FastAPI app serving ``state``'s bootstrap; ``on_fatal`` runs when it cannot even start
    (a backend that does not import, an unwritable trace file): the server should exit."""
    app = FastAPI(title="executor-bootstrap", lifespan=_lifespan(state, on_fatal))
    app.state.serve = state
    app.state.metrics = ServeMetrics(state)
    app.state.created = time.time()
    install_handlers(app)
    app.include_router(startup_routes.router)
    app.include_router(live_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(status_routes.router)
    document_bodies(app)
    if state.options.traces:  # inside the key check: a refused request is not traced
        app.add_middleware(RequestTracing, tracer=state.tracer, ratio=state.options.request_trace_ratio)
    app.add_middleware(JsonBodyMiddleware)  # inside the key check: a request without the key learns nothing
    if state.options.api_key is not None:
        app.add_middleware(APIKeyMiddleware, key=state.options.api_key)
        log.info(
            "bootstrap serve: an API key is required ('Authorization: Bearer <key>') on every route except %s",
            ", ".join(sorted(OPEN)),
        )
    if state.options.allowed_origins:  # outside the key check: a preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(state.options.allowed_origins), **CORS)
    if state.options.host is not None:
        app.add_middleware(SameSiteMiddleware, bound_host=state.options.host, allowed=state.options.allowed_origins)
    _warn_if_open(state)
    app.add_middleware(BodyLimitMiddleware)  # a body too large is refused before anything reads it
    app.add_middleware(ServerErrors)  # outermost: whatever fails inside is answered in OpenAI's shape
    return app


def _warn_if_open(state: ServeState) -> None:
    """Say once, at start, that a server bound to an address other than loopback has no key."""
    options = state.options
    if not open_bind(options):
        return
    if options.allow_open_operations:
        log.warning(
            "bootstrap serve: bound to %r without --api-key and with --allow-open-operations: anyone who reaches "
            "the port runs generations and the live operations (swap, weights, sleep, wake)",
            options.host,
        )
    else:
        log.warning(
            "bootstrap serve: bound to %r without --api-key: anyone who reaches the port runs generations; the "
            "live operations are refused (403) until a key is set (or --allow-open-operations)",
            options.host,
        )


def _lifespan(state: ServeState, on_fatal: Callable[[], None]):
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with anyio.create_task_group() as tg:
                app.state.tasks = tg
                tg.start_soon(build_task.guarded, state, build_task.run_bootstrap, tg, on_fatal)
                tg.start_soon(drain_on_shutdown, state)
                try:
                    yield
                finally:
                    state.begin_shutdown()
                    tg.cancel_scope.cancel()
        finally:
            await release(state)

    return lifespan


async def drain_on_shutdown(state: ServeState) -> None:
    """Once shutdown begins: cancel the bootstrap, give requests in flight their grace period,
    then cancel what is left in the executor (each stream then gets its final chunk)."""
    await state.stopping.wait()
    if state.build_scope is not None:
        state.build_scope.cancel()
    with anyio.move_on_after(state.options.shutdown_timeout_s):
        await state.inflight.wait_idle()
    if len(state.inflight):
        log.warning(
            "shutdown: cancelling %d request(s) still running after %.1f s",
            len(state.inflight),
            state.options.shutdown_timeout_s,
        )
    state.cut_short()


async def release(state: ServeState) -> None:
    """Shut the executor down and release every stage's artifact; shielded, idempotent."""
    with anyio.CancelScope(shield=True):
        state.serve_executor(None)  # the channel first, within draining: the executor's shutdown answers nobody
        state.track_process(None)  # draining ends: the shutdown phase is the Bootstrap's own
        if state.boot is not None:
            await state.boot.aclose()
        if state.ranks is not None:  # serve --tp N: the other ranks release theirs and exit
            await anyio.to_thread.run_sync(state.ranks.stop)
    log.info("bootstrap serve: executor shut down, everything released")
