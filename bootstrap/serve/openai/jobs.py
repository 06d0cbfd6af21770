"""One request in the engine, from ``enqueue`` to its final event, cancelled however it ends.

``Job.close`` runs whatever way the request's handler ends (done, client gone, handler
cancelled, server shutting down): a request that has not finished is cancelled in the engine
explicitly and read to its final event (how it ended, its timing), or, if that does not come
in time, forgotten by the channel's client.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
from starlette.requests import Request

from bootstrap.engine.request.stream_event import REJECTED
from bootstrap.serve.errors import APIError
from bootstrap.serve.metrics import ServeMetrics
from bootstrap.serve.openai.readiness import ready_executor
from bootstrap.serve.openai.schemas import finish_reason
from bootstrap.serve.state import ServeState

if TYPE_CHECKING:
    from bootstrap.engine.request.stream_event import StreamEvent
    from bootstrap.engine.request.timing import RequestTiming
    from bootstrap.engine.sampling.params import SamplingParams

CANCEL_WAIT_S = 10.0  # a cancel is taken at the executor's next step; this only bounds a stuck one
T = TypeVar("T")


def enqueue(
    state: ServeState, ids: list[int], params: SamplingParams, n: int = 1, cache_salt: str | None = None
) -> list[int]:
    """The request ids of ``n`` choices of one prompt (``n`` > 1: prefilled once, its KV shared);
    ``cache_salt`` (checked in ``schemas``) is passed only when given, so an unsalted call is as before."""
    executor = ready_executor(state)  # again: an operation may have begun while the prompt was read
    salted = {} if cache_salt is None else {"cache_salt": cache_salt}
    try:
        if n == 1:
            return [executor.enqueue(ids, params, **salted)]
        return executor.enqueue_choices(ids, params, n, **salted)
    except RuntimeError as exc:  # shut down between the readiness check and here
        raise APIError(503, f"the executor is not taking requests: {exc}", code="shutting_down") from exc


class Job:
    """One enqueued request (``enqueue``), from its first event to ``close``."""

    def __init__(
        self,
        state: ServeState,
        metrics: ServeMetrics,
        endpoint: str,
        request_id: int,
        prompt_tokens: int,
        *,
        prefills: bool = True,
    ) -> None:
        """``prefills``: this choice computes its prompt (the first of ``n``; the others share its
        prefill), so the metrics count the prompt once, as ``usage`` does."""
        self.executor, self.state, self.metrics, self.endpoint = state.executor, state, metrics, endpoint
        self.prompt_tokens, self.prefills = prompt_tokens, prefills
        self.started = time.monotonic()
        self.request_id = request_id
        state.inflight.add(self.request_id)
        self._first: StreamEvent | None = None
        self.tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.timing: RequestTiming | None = None  # once it ended in the engine
        self.cached_tokens = 0  # once it ended: prompt tokens whose KV the prefix cache held
        self._closed = False

    async def first_event(self) -> StreamEvent:
        """The first event; a request the executor refused at once is a 400 with its reason."""
        self._first = await self._next()
        if self._first.finished and self._first.error and self._first.error.startswith(REJECTED):
            await self.close()
            raise APIError(400, self._first.error.removeprefix(REJECTED), code="invalid_request")
        return self._first

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event, the first one included, until the final one (``finish_reason`` set)."""
        if self._first is None:
            await self.first_event()
        yield self._first
        while self.finish_reason is None:
            yield await self._next()

    async def batches(self) -> AsyncIterator[list[StreamEvent]]:
        """``events`` as they come, several at once when the reader fell behind (one wake, one
        write of a stream for all of them), until the final one."""
        if self._first is None:
            await self.first_event()
        yield [self._first]
        while self.finish_reason is None:
            yield [self._took(event) for event in await self.executor.next_events(self.request_id)]

    async def _next(self) -> StreamEvent:
        return self._took(await self.executor.next_event(self.request_id))

    def _took(self, event: StreamEvent) -> StreamEvent:
        if event.token_id is not None:
            if self.tokens == 0:
                self.metrics.ttft.labels(self.endpoint).observe(time.monotonic() - self.started)
            self.tokens += 1
            self.state.tokens_generated += 1
        if event.finished:
            self.finish_reason, self.error, self.timing = event.finish_reason, event.error, event.timing
            self.cached_tokens = event.cached_tokens or 0
        return event

    @property
    def reason(self) -> str:
        """How it ended, as the server says it (``abort`` for a request cut short)."""
        return finish_reason(self.finish_reason or "cancelled")

    async def close(self) -> None:
        """Idempotent; safe to call from a cancelled task (the clean-up is shielded)."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            with anyio.CancelScope(shield=True):
                await self._cancel()
        self.state.inflight.discard(self.request_id)
        self._record()

    async def _cancel(self) -> None:
        """Cancel the request and read it to its final event (how it ended, its timing); one not
        ended within ``CANCEL_WAIT_S`` is forgotten, so the client drops it whenever it ends."""
        self.executor.cancel(self.request_id)
        with anyio.move_on_after(CANCEL_WAIT_S):
            while self.finish_reason is None:
                await self._next()
        if self.finish_reason is None:
            self.executor.forget(self.request_id)

    def _record(self) -> None:
        reason = self.reason
        self.metrics.requests.labels(self.endpoint, reason).inc()
        self.metrics.prompt_tokens.inc(self.prompt_tokens if self.prefills else 0)
        self.metrics.generated_tokens.inc(self.tokens)
        if reason in ("stop", "length"):
            self.metrics.e2e.labels(self.endpoint).observe(time.monotonic() - self.started)


async def unless_disconnected(request: Request, fn: Callable[[], Awaitable[T]]) -> T | None:
    """``await fn()``, or None once the client disconnects (``fn`` is then cancelled). Errors
    of ``fn`` come out as they are, not wrapped in an exception group."""
    value: T | None = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_when_gone, request, tg.cancel_scope)
        try:
            value = await fn()
        except Exception as exc:
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return value


async def _cancel_when_gone(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
