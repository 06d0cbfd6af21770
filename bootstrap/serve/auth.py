"""The optional API key: once set, every route but the probes needs it, checked before anything
else reads the request.

``Authorization: Bearer <key>``; the comparison is constant-time (``hmac.compare_digest``).
Open without the key: ``/health``, ``/ready`` and ``/metrics`` (``OPEN``), for orchestrators and
scrapers. Everything else is refused with 401 without it: the ``/v1`` routes, and also FastAPI's
``/docs``, ``/redoc`` and ``/openapi.json`` (they describe every route and parameter), an
unknown path (a 401, not a 404 that would map the server), and any route added later: the list
names what is open, not what is guarded. The docs stay served to a client that sends the key.

The configured key loses its surrounding whitespace first (``ServeOptions``): a key read from a
file or an env file keeps its newline, and a client never sends it.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from bootstrap.serve.errors import APIError
from bootstrap.serve.state import clean_api_key

OPEN = frozenset({"/health", "/ready", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self._key = app, clean_api_key(key).encode()  # as ServeOptions keeps it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN:
            error = self._check(dict(scope["headers"]).get(b"authorization"))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, header: bytes | None) -> APIError | None:
        scheme, _, given = (header or b"").partition(b" ")
        if header is None or scheme.lower() != b"bearer":
            return _unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(given.strip(), self._key):
            return _unauthorized("invalid API key")
        return None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
