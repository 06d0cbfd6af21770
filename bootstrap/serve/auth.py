"""The optional API key, the refusal of other sites, and who may run the live operations.

The key: once set, every route but ``/health``, ``/ready`` and ``/metrics`` (``OPEN``) needs it,
checked first and in constant time, as ``Authorization: Bearer <key>`` or as HTTP Basic's password
(a browser cannot send the header for the status page, so a page request without the key is
challenged with ``Basic``). Everything else is a 401 without it, unknown paths included: the list
names what is open, not what is guarded. A request that changes something (any method but GET,
HEAD, OPTIONS) with Basic credentials from another site (``Sec-Fetch-Site``, ``Origin``) is a 403.
With or without a key, a server on any address takes nothing from other sites, and one on a
loopback address no foreign ``Host`` (``SameSiteMiddleware``; ``--allowed-origins`` names
exceptions). On an address other than loopback the live operations need the key, or the
operator's explicit ``--allow-open-operations`` (``operations_allowed``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from bootstrap.serve.errors import APIError
from bootstrap.serve.state import ServeOptions, clean_api_key

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


class SameSiteMiddleware:
    """For a server bound to any address: a request the browser marks as from another site
    (``Sec-Fetch-Site``, ``Origin``) is refused with 403, unless its ``Origin`` is in ``allowed``;
    bound to a loopback address, also a ``Host`` that is not a loopback name (DNS rebinding: a
    page whose name now points here), the host names of ``allowed`` taken too. Elsewhere any
    ``Host`` is taken: the names a server on ``0.0.0.0`` answers to are not known here."""

    def __init__(self, app: ASGIApp, bound_host: str, allowed: tuple[str, ...] = ()) -> None:
        self.app, self._origins = app, frozenset(origin.encode() for origin in allowed)
        names = {"localhost", "127.0.0.1", "[::1]", _bracketed(bound_host.lower())}
        names.update(_host_name(origin.partition("://")[2].encode()).decode() for origin in allowed)
        self._hosts = frozenset(name.encode() for name in names) if is_loopback(bound_host) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(dict(scope["headers"]))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, headers: dict[bytes, bytes]) -> APIError | None:
        host = headers.get(b"host", b"").lower()
        if self._hosts is not None and _host_name(host) not in self._hosts:
            return APIError(
                403,
                f"refused: Host {host.decode('latin-1')!r} is not this server's (allowed on a loopback "
                "address: localhost, 127.0.0.1, [::1] or the bound host, with any port, or a host "
                "--allowed-origins names)",
                code="foreign_host",
            )
        origin = headers.get(b"origin")
        if _cross_site(headers) and (origin is None or origin.lower() not in self._origins):
            return APIError(
                403,
                "refused: a request from another site (Sec-Fetch-Site, Origin); allowed: the origins "
                "--allowed-origins names",
                code="cross_site",
            )
        return None


def open_bind(options: ServeOptions) -> bool:
    """Whether anyone who reaches the port reaches the server: bound to an address other than
    loopback, without a key."""
    return options.host is not None and not is_loopback(options.host) and options.api_key is None


def operations_allowed(request: Request) -> None:
    """The live operations' dependency: 403 on an address other than loopback without a key,
    unless the operator opened them (``--allow-open-operations``); a read (GET) passes."""
    options: ServeOptions = request.app.state.serve.options
    if request.method in SAFE_METHODS or not open_bind(options) or options.allow_open_operations:
        return
    raise APIError(
        403,
        f"refused: live operations on a server bound to {options.host!r} need its --api-key (or "
        "--allow-open-operations, which opens them to anyone who reaches the port)",
        code="operations_closed",
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as ``--host`` gives it) is a loopback address or ``localhost``."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    """An IPv6 address as a ``Host`` header writes it (``[::1]``); anything else as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _host_name(host: bytes) -> bytes:
    """``host[:port]`` without its port (``[::1]:8000`` is ``[::1]``); a port that is not digits
    keeps it whole, so it matches no name."""
    name, sep, port = host.rpartition(b":")
    if not sep or name.endswith(b":") or (host.startswith(b"[") and not name.endswith(b"]")):
        return host  # no port, or an IPv6 address without brackets (no Host header carries one)
    return name if port.isdigit() else host


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
