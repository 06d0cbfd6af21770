"""The status page (``GET /``, one self-contained HTML file: ``status_page.html``) and the
engine's figures it shows once the server is ready (``GET /v1/engine``). Both sit behind the
API key like every ``/v1`` route; a browser is asked for it with HTTP Basic (``auth``)."""

from __future__ import annotations

import base64
import hashlib
import time
from functools import cache
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from bootstrap.serve.state import ServeState

if TYPE_CHECKING:
    from bootstrap.engine.executor.channel.client import EngineClient  # zmq: with the first executor

router = APIRouter()


@cache
def page() -> tuple[str, dict[str, str]]:
    """The page and its headers: a content security policy that runs only its own script and
    style (by their hashes) and lets it reach only this server."""
    html = files("bootstrap.serve.status").joinpath("status_page.html").read_text(encoding="utf-8")
    script, style = (_inline(html, tag) for tag in ("script", "style"))
    policy = (
        f"default-src 'none'; script-src '{script}'; style-src '{style}'; img-src data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html, {"Cache-Control": "no-cache", "Content-Security-Policy": policy}


def _inline(html: str, tag: str) -> str:
    """The CSP hash source of the page's one inline ``tag`` element."""
    body = html.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
    return "sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def status_page() -> HTMLResponse:
    """The live status page: stages as they run, the plan, then the engine's load."""
    html, headers = page()
    return HTMLResponse(html, headers=headers)


@router.get("/v1/engine")
async def engine(request: Request) -> dict[str, Any]:
    """The engine's load now (null before the executor is ready), the tokens generated so far,
    the slowest of the recently answered requests, slowest first, and how many live operations
    began so far (the page polls this: a new one, or a new phase, and it reads ``/v1/bootstrap``)."""
    state: ServeState = request.app.state.serve
    live = state.executor is not None and state.phase in ("ready", "shutting_down")
    return {
        "state": state.phase,
        "server_time": time.time(),
        "engine": _engine(state.executor) if live else None,
        "in_flight": len(state.inflight),
        "tokens_generated": state.tokens_generated,
        "requests_answered": state.recent.answered,
        "slowest": state.recent.slowest(),
        "operation_count": len(state.boot.operations) if state.boot is not None else 0,
    }


def _engine(executor: EngineClient) -> dict[str, Any]:
    """The load, and the prefix cache's figures (its tokens counted since this engine started)."""
    stats = executor.engine_stats()
    return {
        "kv_total_blocks": stats.kv_total_blocks,
        "kv_used_blocks": stats.kv_used_blocks,
        "kv_capacity_tokens": stats.kv_capacity_tokens,
        "kv_dtype": stats.kv_dtype,
        "running": stats.running,
        "waiting": stats.waiting,
        "prefix_caching": stats.prefix_caching,
        "overlap": stats.overlap,
        "kv_cached_blocks": stats.kv_cached_blocks,
        "kv_cached_free_blocks": stats.kv_cached_free_blocks,
        "prefix_query_tokens": stats.prefix_query_tokens,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "prefix_hit_rate": stats.prefix_hit_rate,
    }
