"""The optional API key: once set, every route but the probes needs it, checked before anything
else reads the request.

``Authorization: Bearer <key>``, compared in constant time (``hmac.compare_digest``). A browser
cannot send that header for the status page (``GET /``) or its event stream, so HTTP Basic is
taken too, the key as the password: a page request (``Accept: text/html``) without the key is
challenged with ``Basic`` and the browser sends the key with the page's own requests. Since a
browser also sends those credentials with requests other sites make it send, a request that
changes something (any method but GET, HEAD, OPTIONS) with Basic credentials from another site
(``Sec-Fetch-Site``, ``Origin``) is refused with 403. Open without the key: ``/health``,
``/ready`` and ``/metrics`` (``OPEN``); everything else is a 401 without it, FastAPI's docs and
``/openapi.json``, an unknown path (not a 404 that would map the server) and any route added
later included: the list names what is open, not what is guarded. The configured key loses its
surrounding whitespace first (``ServeOptions``): a key read from a file keeps its newline.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from bootstrap.serve.errors import APIError
from bootstrap.serve.state import clean_api_key

OPEN = frozenset({"/health", "/ready", "/metrics"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self._key = app, clean_api_key(key).encode()  # as ServeOptions keeps it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN:
            error = self._check(scope, dict(scope["headers"]))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        header = headers.get(b"authorization")
        scheme, _, given = (header or b"").partition(b" ")
        scheme = scheme.lower()
        browser = b"text/html" in headers.get(b"accept", b"")
        if header is None or scheme not in (b"bearer", b"basic"):
            return _unauthorized("missing API key: send the header 'Authorization: Bearer <key>'", browser)
        key = given.strip() if scheme == b"bearer" else _basic_password(given)
        if key is None or not hmac.compare_digest(key, self._key):
            return _unauthorized("invalid API key", browser)
        if scheme == b"basic" and scope["method"] not in SAFE_METHODS and _cross_site(headers):
            return APIError(
                403,
                "refused: a request from another site with the browser's saved key (send the "
                "key as 'Authorization: Bearer <key>' instead)",
                code="cross_site",
            )
        return None


def _basic_password(credentials: bytes) -> bytes | None:
    """The password of HTTP Basic credentials (any user name), or None when they do not decode."""
    try:
        _, sep, password = base64.b64decode(credentials.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return None
    return password if sep else None


def _cross_site(headers: dict[bytes, bytes]) -> bool:
    """Whether the browser says the request comes from another site (``Sec-Fetch-Site``), or
    names an ``Origin`` that is not this server's host."""
    if headers.get(b"sec-fetch-site", b"same-origin") not in (b"same-origin", b"none"):
        return True
    origin = headers.get(b"origin")
    return origin is not None and origin.partition(b"://")[2] != headers.get(b"host", b"")


def _unauthorized(message: str, browser: bool) -> APIError:
    """A 401 whose challenge a browser answers with its own key prompt (HTTP Basic, the key as
    password) when it asked for a page; ``Bearer`` for every other client."""
    challenge = 'Basic realm="executor-bootstrap", charset="UTF-8"' if browser else "Bearer"
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})
