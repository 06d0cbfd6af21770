"""The optional API key, checked on every ``/v1`` route before anything else reads the request.

``Authorization: Bearer <key>``; the comparison is constant-time (``hmac.compare_digest``).
Probes (``/health``, ``/ready``) and ``/metrics`` stay open for orchestrators and scrapers.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from bootstrap.serve.errors import APIError

PROTECTED = "/v1"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str) -> None:
        if not key:
            raise ValueError("api key: must be a non-empty string")
        self.app, self._key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _protected(scope["path"]):
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


def _protected(path: str) -> bool:
    return path == PROTECTED or path.startswith(PROTECTED + "/")


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
