"""``RequestTracing`` on a small Starlette app, its spans in memory: the caller's W3C trace
context is continued (recorded when sampled, never when not), a request without one is traced
at the configured ratio, the response always names the server's span in ``traceparent``, and
untraced paths are left alone."""

from __future__ import annotations

import random
import threading

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from bootstrap.pipeline.telemetry import REQUEST_SPAN, SpansWhere, make_tracer_provider, not_request_span
from bootstrap.serve.request_trace import SCOPE_KEY, RequestTracing

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


async def chat(request):
    span = request.state.request_span  # the handler sees the span, or None when not recorded
    if request.query_params.get("fail") == "raise":
        raise RuntimeError("handler blew up")
    status = 503 if request.query_params.get("fail") == "503" else 200
    return JSONResponse({"recorded": span is not None}, status_code=status)


def make(ratio: float, draw=random.random):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/health", lambda r: PlainTextResponse("ok")),
        ]
    )
    tracer = provider.get_tracer("test")
    traced = RequestTracing(app, tracer=lambda: tracer, ratio=ratio, draw=draw)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=traced, raise_app_exceptions=False), base_url="http://server"
    )
    return client, exporter


def parts(header: str) -> tuple[str, str, str, str]:
    version, trace_id, span_id, flags = header.split("-")
    return version, trace_id, span_id, flags


@pytest.mark.anyio
async def test_a_sampled_caller_context_is_continued_and_named_back():
    client, exporter = make(ratio=0.0)  # the ratio does not decide for a caller's sampled context
    async with client:
        response = await client.post(
            "/v1/chat/completions", headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        )
    [span] = exporter.get_finished_spans()
    assert response.json() == {"recorded": True} and span.name == REQUEST_SPAN
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE and f"{span.parent.span_id:016x}" == CALLER_SPAN
    assert parts(response.headers["traceparent"]) == ("00", CALLER_TRACE, f"{span.context.span_id:016x}", "01")
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["url.path"] == "/v1/chat/completions"


@pytest.mark.anyio
async def test_an_unsampled_caller_context_is_not_recorded_but_still_continued():
    client, exporter = make(ratio=1.0)
    async with client:
        response = await client.post(
            "/v1/chat/completions", headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"}
        )
    assert exporter.get_finished_spans() == () and response.json() == {"recorded": False}
    _, trace_id, span_id, flags = parts(response.headers["traceparent"])
    assert (trace_id, flags) == (CALLER_TRACE, "00") and span_id not in (CALLER_SPAN, "0" * 16)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "header", [None, "garbage", f"00-{'0' * 32}-{CALLER_SPAN}-01", f"00-{CALLER_TRACE}-{'0' * 16}-01"]
)
async def test_without_a_valid_context_the_ratio_decides_and_a_new_trace_starts(header):
    headers = {"traceparent": header} if header else {}
    on, on_spans = make(ratio=1.0)
    off, off_spans = make(ratio=0.0)
    async with on, off:
        traced = await on.post("/v1/chat/completions", headers=headers)
        untraced = await off.post("/v1/chat/completions", headers=headers)
    [span] = on_spans.get_finished_spans()
    assert span.parent is None and off_spans.get_finished_spans() == ()
    _, trace_id, span_id, flags = parts(traced.headers["traceparent"])
    assert (trace_id, span_id) == (f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}")
    assert int(flags, 16) & 1 == 1  # sampled (the SDK may add W3C level 2's "random" flag, 0x02)
    _, trace_id, _, flags = parts(untraced.headers["traceparent"])
    assert int(flags, 16) & 1 == 0 and trace_id not in (CALLER_TRACE, "0" * 32)


@pytest.mark.anyio
async def test_a_ratio_of_a_tenth_records_exactly_the_draws_under_it():
    draws = random.Random(7)
    replay = random.Random(7)
    expected = sum(replay.random() < 0.1 for _ in range(200))
    client, exporter = make(ratio=0.1, draw=draws.random)
    async with client:
        replies = [await client.post("/v1/chat/completions") for _ in range(200)]
    assert len(exporter.get_finished_spans()) == expected == sum(r.json()["recorded"] for r in replies)
    assert 5 <= expected <= 40  # the seed's draw is a tenth-ish: the test checks the counting, not luck


@pytest.mark.anyio
async def test_server_errors_mark_the_span_and_untraced_paths_are_left_alone():
    client, exporter = make(ratio=1.0)
    async with client:
        unavailable = await client.post("/v1/chat/completions?fail=503")
        crashed = await client.post("/v1/chat/completions?fail=raise")
        health = await client.get("/health")
    failed, raised = exporter.get_finished_spans()
    assert unavailable.status_code == 503 and failed.status.status_code.name == "ERROR"
    assert crashed.status_code == 500 and raised.status.status_code.name == "ERROR"
    assert raised.events[0].name == "exception" and "handler blew up" in raised.status.description
    assert "traceparent" not in health.headers


def test_request_spans_stay_out_of_a_bootstraps_in_memory_copy():
    kept, everything = InMemorySpanExporter(), InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SpansWhere(SimpleSpanProcessor(kept), not_request_span))
    provider.add_span_processor(SimpleSpanProcessor(everything))
    tracer = provider.get_tracer("test")
    for name in (
        "bootstrap.pipeline",
        REQUEST_SPAN,
        f"{REQUEST_SPAN}.choice",
        f"{REQUEST_SPAN}.decode",
        "bootstrap.requests",
    ):
        tracer.start_span(name).end()
    assert [s.name for s in kept.get_finished_spans()] == ["bootstrap.pipeline", "bootstrap.requests"]
    assert len(everything.get_finished_spans()) == 5
    assert SCOPE_KEY == "request_span"  # the name the route handlers read from request.state


def test_request_spans_reach_the_trace_file_in_batches_flushed_before_it_closes(tmp_path):
    path = tmp_path / "trace.jsonl"
    provider = make_tracer_provider(trace_file=path, requests=True)
    tracer = provider.get_tracer("test")
    tracer.start_span("bootstrap.stage.load_model").end()
    assert "bootstrap.stage.load_model" in path.read_text()  # the bootstrap's: written as each ends
    for _ in range(5000):  # a burst past the SDK's default queue of 2048: none is dropped
        tracer.start_span(REQUEST_SPAN).end()
    provider.shutdown()  # flushes the batches into the file, joins the exporting thread, then closes the file
    names = [line.split('"name": "')[1].split('"')[0] for line in path.read_text().splitlines()]
    assert names.count(REQUEST_SPAN) == 5000 and names[0] == "bootstrap.stage.load_model"
    assert not [t for t in threading.enumerate() if "OtelBatchSpanRecordProcessor" in t.name]
