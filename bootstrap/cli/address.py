"""``serve``'s address checked before anything starts: ``--host`` one of this machine's, ``--port``
free to listen on (``check_host``)."""

from __future__ import annotations

import ipaddress
import os
import re
import socket

from bootstrap.config import ConfigError


def check_host(host: str, port: int = 0) -> None:
    """``--host`` resolved and bound on a test socket (closed at once) before anything starts, so
    an address that is not this machine's, or a ``--port`` another process listens on, fails in
    milliseconds with exit 2 naming the cause, not after the engine's imports and a first stage.
    The test socket reuses addresses as uvicorn's does (a port in TIME_WAIT is free to both).
    Dotted digits that are no IPv4 address (``256.0.0.1``) are refused before ``getaddrinfo``,
    which would send them to DNS as a name."""
    if not host or (re.fullmatch(r"[0-9.]+", host) and not _is_ipv4(host)):
        raise ConfigError(
            f"host: {host!r} is not an IP address or host name (allowed: an address of this machine, "
            "e.g. 127.0.0.1, 0.0.0.0, ::1, localhost)"
        )
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"host: cannot bind {host!r}: {exc} (allowed: an address of this machine, "
            "e.g. 127.0.0.1, 0.0.0.0, ::1, localhost)"
        ) from None
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
                raise ConfigError(
                    f"port: cannot listen on {host}:{port}: {reason} (allowed: a port no other process "
                    "listens on, 1-65535, or 0 for a free one)"
                ) from None


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True
