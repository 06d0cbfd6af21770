"""Every request that changes something (a POST, any method but GET, HEAD, OPTIONS) declares its
body as JSON (issue 54).

A cross-site form or a simple ``fetch`` can send ``text/plain``, a URL-encoded or a multipart
body without the browser asking first; ``application/json`` it cannot send without a CORS
preflight, which this server answers only for ``--allowed-origins``. So a body of any other
``Content-Type``, or of none, is a 415 in OpenAI's error shape before anything reads it. A
request without a body (``Content-Length`` absent or 0, no ``Transfer-Encoding``) and without a
``Content-Type`` is taken: ``POST /v1/bootstrap/wake`` or vLLM's ``POST /sleep?level=1`` as
curl and the status page send them; a browser's body-less cross-site request still carries
``Sec-Fetch-Site`` or ``Origin``, which ``auth.SameSiteMiddleware`` refuses on every address.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from bootstrap.serve.errors import APIError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON = b"application/json"


class JsonBodyMiddleware:
    """ASGI middleware: a request that changes something is refused with 415 unless its body is
    declared ``application/json`` (any parameters, any case) or it has neither body nor type."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            error = _check(dict(scope["headers"]))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _check(headers: dict[bytes, bytes]) -> APIError | None:
    declared = headers.get(b"content-type")
    if declared is None:
        if headers.get(b"content-length", b"0").strip() == b"0" and b"transfer-encoding" not in headers:
            return None  # no body at all
        got = "no Content-Type"
    elif declared.partition(b";")[0].strip().lower() == JSON:
        return None
    else:
        got = f"Content-Type {declared.decode('latin-1')[:80]!r}"
    return APIError(
        415,
        f"Content-Type: a body with {got}; allowed: 'application/json' (a request without a body may "
        "leave the header out)",
        param="Content-Type",
        code="unsupported_media_type",
    )
