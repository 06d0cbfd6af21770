"""Request traces: a span per generation request, in the bootstrap's trace pipeline (its JSON
Lines file and OTLP), continuing the caller's W3C trace context.

``RequestTracing`` (an ASGI middleware, on ``/v1/completions`` and ``/v1/chat/completions``)
reads the caller's ``traceparent``. A valid one decides: its trace is continued, and recorded
when its ``sampled`` flag is set. Without one, the server starts a trace and records it with
probability ``ratio`` (``--request-trace-ratio``), making no span object for the others. Either
way the response carries a ``traceparent`` naming the server's span.

The request span runs from the request's arrival to its last byte (or its error) and holds the
endpoint, the HTTP status, tokens in and out and the finish reasons. Once its choices are
closed (``Choices.close``), each gets a ``bootstrap.request.choice`` span with its queue, prefill
and decode spans, placed from the engine's own timing (``bootstrap.engine.request.timing``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bootstrap.pipeline.telemetry import CHOICE_SPAN, REQUEST_SPAN, request_phase_span

if TYPE_CHECKING:
    from bootstrap.serve.openai.jobs import Job

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
SCOPE_KEY = "request_span"  # where the handler finds the span: ``request.state.request_span``
CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # OpenTelemetry's GenAI name: prompt tokens from the cache
_PROPAGATOR = TraceContextTextMapPropagator()
_IDS = RandomIdGenerator()


class RequestTracing:
    """See the module docstring. ``tracer`` returns the trace pipeline's tracer, or None while
    there is none yet (the bootstrap is still being made: such a request is not traced)."""

    def __init__(
        self, app: ASGIApp, tracer: Callable[[], Tracer | None], ratio: float, draw: Callable[[], float] = random.random
    ) -> None:
        self.app, self._tracer, self.ratio, self._draw = app, tracer, ratio, draw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = self._tracer() if scope["type"] == "http" and scope["path"] in TRACED_PATHS else None
        if tracer is None:
            await self.app(scope, receive, send)
            return
        parent = _PROPAGATOR.extract(_headers(scope))
        remote = trace.get_current_span(parent).get_span_context()  # the caller's, valid when it sent one
        span = self._start(tracer, parent, remote, scope)
        context = span.get_span_context() if span is not None else _unsampled(remote)
        scope.setdefault("state", {})[SCOPE_KEY] = span
        header = (b"traceparent", traceparent(context).encode())

        async def send_with_context(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
                if span is not None:
                    _answered(span, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_context)
        except BaseException as exc:
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if span is not None:
                span.end()

    def _start(self, tracer: Tracer, parent: Context, remote: SpanContext, scope: Scope) -> Span | None:
        """The request's span when it is to be recorded, else None."""
        sampled = remote.trace_flags.sampled if remote.is_valid else self._draw() < self.ratio
        if not sampled:
            return None
        return tracer.start_span(
            REQUEST_SPAN,
            context=parent if remote.is_valid else Context(),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        )


def traceparent(context: SpanContext) -> str:
    """The W3C ``traceparent`` header naming ``context``."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _unsampled(remote: SpanContext) -> SpanContext:
    """The context a request that is not recorded answers with: the caller's trace, else a new
    one, a span id of its own, and the ``sampled`` flag off."""
    trace_id = remote.trace_id if remote.is_valid else _IDS.generate_trace_id()
    return SpanContext(trace_id, _IDS.generate_span_id(), is_remote=False, trace_flags=TraceFlags(0))


def _headers(scope: Scope) -> dict[str, str]:
    wanted = (b"traceparent", b"tracestate")
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in wanted}


def _answered(span: Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))


# ---- the choices, once closed ---------------------------------------------------------------


def record_choices(
    span: Span | None,
    tracer: Tracer | None,
    endpoint: str,
    jobs: Iterable[Job],
    prompt_tokens: int,
    cached_tokens: int = 0,
) -> None:
    """The request's totals on ``span`` (``cached_tokens``: of its prompt tokens, those the prefix
    cache held, as ``usage`` counts them), and a choice span (with its phases) per closed job;
    nothing when the request is not recorded."""
    if span is None or tracer is None or not span.is_recording():
        return
    jobs = list(jobs)
    span.set_attributes(
        {
            "bootstrap.endpoint": endpoint,
            "bootstrap.choices": len(jobs),
            "gen_ai.usage.input_tokens": prompt_tokens,
            CACHED_TOKENS: cached_tokens,
            "gen_ai.usage.output_tokens": sum(job.tokens for job in jobs),
            "gen_ai.response.finish_reasons": [job.reason for job in jobs],
        }
    )
    context = trace.set_span_in_context(span)
    for index, job in enumerate(jobs):
        if job.timing is not None:
            _record_choice(tracer, context, index, job)


def _record_choice(tracer: Tracer, context: Context, index: int, job: Job) -> None:
    t = job.timing
    choice = tracer.start_span(
        CHOICE_SPAN,
        context=context,
        start_time=t.enqueued_ns,
        attributes={
            "bootstrap.choice": index,
            "bootstrap.request_id": job.request_id,
            "bootstrap.finish_reason": job.reason,
            "gen_ai.usage.input_tokens": job.prompt_tokens,
            CACHED_TOKENS: job.cached_tokens,
            "gen_ai.usage.output_tokens": job.tokens,
            "bootstrap.kv_blocks": t.kv_blocks,
        },
    )
    inside = trace.set_span_in_context(choice)
    _phase(tracer, inside, "queue", t.enqueued_ns, t.scheduled_ns or t.finished_ns, {})
    if t.scheduled_ns is not None:
        _phase(
            tracer,
            inside,
            "prefill",
            t.scheduled_ns,
            t.first_token_ns or t.finished_ns,
            {"bootstrap.tokens": job.prompt_tokens, "bootstrap.steps": t.prefill_steps},
        )
    if t.first_token_ns is not None:
        _phase(
            tracer,
            inside,
            "decode",
            t.first_token_ns,
            t.finished_ns,
            {"bootstrap.tokens": job.tokens, "bootstrap.steps": max(job.tokens - 1, 0)},
        )
    if job.reason == "error":
        choice.set_status(Status(StatusCode.ERROR, job.error or "generation failed"))
    choice.end(end_time=t.finished_ns)


def _phase(tracer: Tracer, context: Context, phase: str, start: int, end: int, attributes: dict[str, int]) -> None:
    tracer.start_span(request_phase_span(phase), context=context, start_time=start, attributes=attributes).end(
        end_time=end
    )
