"""A bound on every request body, checked before any JSON is parsed (issue 20).

Without it one 9 MB prompt was read, parsed and tokenized in full before any length check. The
bound is generous (``MAX_BODY_BYTES``, far above what a prompt of any served ``max_seq_len``
needs as JSON) and is checked twice: from ``Content-Length`` before reading anything, and while
the body streams in, for chunked uploads that declare no length. Either way the client gets a
413 in OpenAI's error shape naming the limit, and the handler never sees the rest.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bootstrap.serve.errors import APIError

MAX_BODY_BYTES = 8 * 1024 * 1024  # 8 MiB


def too_large(limit: int, got: str) -> APIError:
    return APIError(
        413, f"body: {got}; allowed: at most {limit} bytes (MAX_BODY_BYTES)", param="body", code="request_too_large"
    )


class BodyLimitMiddleware:
    """ASGI middleware: a body over ``limit`` bytes is answered 413 and not passed on."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            return await _answer(too_large(self.limit, f"Content-Length {declared} bytes"), send)
        await _LimitedRequest(self, receive, send).run(scope)


class _LimitedRequest:
    """One request: counts the body as the app reads it; past the limit, answers 413 itself and
    tells the app the client is gone (so it stops), dropping whatever the app still sends."""

    def __init__(self, middleware: BodyLimitMiddleware, receive: Receive, send: Send) -> None:
        self.middleware, self._receive, self._send = middleware, receive, send
        self.received, self.refused, self.started = 0, False, False

    async def run(self, scope: Scope) -> None:
        try:
            await self.middleware.app(scope, self.receive, self.send)
        except Exception:
            if not self.refused:  # the app's own error: not ours to hide
                raise

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.middleware.limit:
                self.refused, started = True, self.started
                if not started:  # a response already begun cannot become a 413: the client is dropped
                    sent = f"more than {self.middleware.limit} bytes sent"
                    await _answer(too_large(self.middleware.limit, sent), self._send)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if not self.refused:
            self.started = self.started or message["type"] == "http.response.start"
            await self._send(message)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # not a number: the server itself refuses it
    return None


async def _answer(error: APIError, send: Send) -> None:
    response = error.response()
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
