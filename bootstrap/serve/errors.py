"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server answers goes through ``APIError`` or one of the handlers here, so a
client sees one shape for a bad body (400), an unknown model (404), a missing or wrong key
(401), a body over the size limit (413, ``body_limit``), a request before the executor is ready
(503 with ``Retry-After``) and anything else: an exception no route answered is a 500
``server_error`` naming nothing of the server's insides, its traceback in the server's log
(``ServerErrors``); a stream it cut short ends with that error as an event, then ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import reprlib
from itertools import islice

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bootstrap.serve.openai.render import DONE

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable",
}
MAX_DESCRIBED = 8  # bad fields named in one message; the rest are counted
INTERNAL = "the server failed to answer this request (an internal error: the server's log has its details)"
log = logging.getLogger("bootstrap.serve")


class APIError(Exception):
    """An answer in OpenAI's error shape; ``param`` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        kind = TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def describe_validation(exc: RequestValidationError | ValidationError) -> APIError:
    """One line per bad field (the first ``MAX_DESCRIBED``): its dotted path, what is allowed,
    and an excerpt of what was sent."""
    lines: list[str] = []
    params: list[str | None] = []
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
    for err in errors[:MAX_DESCRIBED]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            params.append(None)
            lines.append(f"body: not valid JSON ({err.get('ctx', {}).get('error', message)})")
            continue
        params.append(field)
        if err.get("type") == "missing":
            lines.append(f"{field}: required")
        else:
            lines.append(f"{field}: {message} (got {_short(err.get('input'))})")
    if len(errors) > MAX_DESCRIBED:
        lines.append(f"and {len(errors) - MAX_DESCRIBED} more")
    return bad_request("; ".join(lines), param=params[0] if len(params) == 1 else None)


class _Excerpt(reprlib.Repr):
    """``reprlib`` with small limits, and dicts in their own order: ``reprlib`` sorts all keys first."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict = 3, 8, 8, 8
        self.maxstring = self.maxlong = self.maxother = 80

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"


_EXCERPT = _Excerpt()


def _short(value: object) -> str:
    """A bounded ``repr``: a value of millions of items costs no more than a few of them."""
    text = _EXCERPT.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return describe_validation(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()


class ServerErrors:
    """ASGI middleware, outermost: an exception that escapes every route and handler is logged
    with its traceback and answered as OpenAI's 500 (``INTERNAL``), never starlette's plain
    text; after a stream began (``text/event-stream``), its body ends with the error as an
    event, then ``[DONE]``. A response already sent whole stays as it was."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started: Message | None = None
        ended = False

        async def sending(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = message
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            error = APIError(500, INTERNAL, code="internal_error")
            if started is None:
                await error.response()(scope, receive, send)
            elif not ended and _is_stream(started):
                event = f"data: {json.dumps(error.body())}\n\n{DONE}"
                await send({"type": "http.response.body", "body": event.encode(), "more_body": False})


def _is_stream(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])
