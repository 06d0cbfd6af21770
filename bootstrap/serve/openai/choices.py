"""The choices of one OpenAI request: ``n`` jobs per prompt (completions take a list), each
answered as its own choice, ``index`` = prompt index * ``n`` + choice (as vLLM numbers them).
The ``n`` choices of a prompt are one prefill in the engine, their prompt's KV blocks shared
(``PyExecutor.enqueue_choices``); ``usage`` counts each prompt once, its cached tokens those of
its first choice (the one that prefilled it).

Every job is enqueued before any is awaited, so the engine batches them. A refusal of any is the
request's 400, and every job is closed whatever way the request ends. Streamed, the choices'
events are merged in the order they come: each job has a pump task, in a task group that
``ChoicesStream`` opens around the sending of the body (one choice needs none: its events are the
body's). No task group is held across a ``yield`` of the body: that would break when a
disconnected client's body is closed from another task.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry.trace import Span
from starlette.responses import StreamingResponse
from starlette.types import Send

from bootstrap.serve.metrics import ServeMetrics
from bootstrap.serve.openai import schemas as s
from bootstrap.serve.openai.jobs import Job, enqueue
from bootstrap.serve.openai.render import SSE_HEADERS, Render, stream_body
from bootstrap.serve.request_trace import record_choices
from bootstrap.serve.state import ServeState
from bootstrap.serve.status.recent import RequestSummary

if TYPE_CHECKING:
    from bootstrap.engine.request.stream_event import StreamEvent
    from bootstrap.engine.sampling.params import SamplingParams


class Choices:
    """The jobs of one request, enqueued in order: job ``i`` is choice ``i`` (``start``). Once
    closed, the request is in the server's recent requests and, when ``span`` records, its
    choices are in the trace (``request_trace``)."""

    def __init__(self, state: ServeState, endpoint: str, prompt_tokens: int, span: Span | None = None) -> None:
        self.jobs: list[Job] = []
        self.state, self.endpoint, self.prompt_tokens, self.span = state, endpoint, prompt_tokens, span
        self._recorded = False

    @classmethod
    async def start(
        cls,
        state: ServeState,
        metrics: ServeMetrics,
        endpoint: str,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        n: int = 1,
        span: Span | None = None,
        cache_salt: str | None = None,
    ) -> Choices:
        """Enqueue ``n`` jobs per prompt (choice ``i * n + j`` is prompt i's j-th); if some
        cannot be (shutting down), those before them are closed."""
        choices = cls(state, endpoint, sum(len(ids) for ids in prompts), span)
        try:
            for ids, p in zip(prompts, params, strict=True):
                for j, request_id in enumerate(enqueue(state, ids, p, n, cache_salt)):
                    choices.jobs.append(Job(state, metrics, endpoint, request_id, len(ids), prefills=j == 0))
        except BaseException:
            await choices.close()
            raise
        return choices

    async def first_events(self) -> bool:
        """Wait for each job's first event: a request the executor refused is a 400 (``Job.first_event``)."""
        for job in self.jobs:
            await job.first_event()
        return True

    async def collect(self) -> list[list[StreamEvent]]:
        """Every event of every job, per choice; the jobs are awaited together."""
        events: list[list[StreamEvent]] = [[] for _ in self.jobs]

        async def collect_one(index: int) -> None:
            events[index] = [event async for event in self.jobs[index].events()]

        async with anyio.create_task_group() as tg:
            for index in range(len(self.jobs)):
                tg.start_soon(collect_one, index)
        return events

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, each prompt counted once (its first choice's)."""
        return sum(job.cached_tokens for job in self.jobs if job.prefills)

    def usage(self) -> s.Usage:
        """Each prompt counted once; every choice's generated tokens."""
        return s.Usage.of(self.prompt_tokens, sum(job.tokens for job in self.jobs), self.cached_tokens)

    async def close(self) -> None:
        """Close every job (idempotent; shielded inside each ``Job.close``), then record the request once."""
        for job in self.jobs:
            await job.close()
        if not self._recorded:
            self._recorded = True
            self._record()

    def _record(self) -> None:
        recording = self.span is not None and self.span.is_recording()
        trace_id = f"{self.span.get_span_context().trace_id:032x}" if recording else None
        self.state.recent.add(RequestSummary.of(self.endpoint, self.jobs, self.prompt_tokens, trace_id))
        record_choices(self.span, self.state.tracer(), self.endpoint, self.jobs, self.prompt_tokens, self.cached_tokens)


class ChoicesStream(StreamingResponse):
    """The SSE response of ``choices``: one choice's batches are the body's own; several are
    pumped by tasks of a task group that lives exactly as long as the body is sent. The jobs are
    closed after it, however it ended (a client gone mid-body skips starlette's background tasks,
    so the close is not one)."""

    def __init__(self, choices: Choices, render: Render, include_usage: bool) -> None:
        self.choices = choices
        self._send: MemoryObjectSendStream[tuple[int, list[StreamEvent]]] | None = None
        self._events: MemoryObjectReceiveStream[tuple[int, list[StreamEvent]]] | None = None
        if len(choices.jobs) == 1:  # no task and no stream between the engine's events and the body
            batches: AsyncIterator[tuple[int, list[StreamEvent]]] = _indexed(choices.jobs[0])
        else:
            # unbounded, as the engine's own event queues are: at most max_tokens events per job (the
            # item type quoted: StreamEvent's module imports torch, so it is imported for type checks only)
            self._send, self._events = anyio.create_memory_object_stream[tuple[int, list["StreamEvent"]]](
                max_buffer_size=math.inf
            )
            batches = self._events
        usage = (lambda: choices.usage()) if include_usage else (lambda: None)
        super().__init__(
            stream_body(batches, len(choices.jobs), render, usage),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def stream_response(self, send: Send) -> None:
        try:
            if self._send is None:
                await super().stream_response(send)
                return
            async with anyio.create_task_group() as tg:
                async with self._send:
                    for index, job in enumerate(self.choices.jobs):
                        tg.start_soon(_pump, index, job, self._send.clone())
                try:
                    await super().stream_response(send)
                finally:
                    tg.cancel_scope.cancel()  # pumps still waiting: their jobs are cancelled by close()
        finally:
            if self._events is not None:
                self._events.close()
            await self.choices.close()


async def _indexed(job: Job) -> AsyncIterator[tuple[int, list[StreamEvent]]]:
    async for batch in job.batches():
        yield 0, batch


async def _pump(index: int, job: Job, out: MemoryObjectSendStream[tuple[int, list[StreamEvent]]]) -> None:
    async with out:
        async for batch in job.batches():
            await out.send((index, batch))
