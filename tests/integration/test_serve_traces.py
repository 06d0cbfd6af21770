"""Request traces from the real server (``bootstrap serve --trace-file``, a tiny checkpoint): a
streamed chat request continuing the caller's ``traceparent`` becomes a request span under the
caller's span, with a choice span and its queue, prefill and decode spans placed end to end from
the engine's own timing; ``n`` choices are a span each; a refused body is a traced 400; and
``bootstrap trace`` lists the requests, the slowest first."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from helpers.serve_process import ServeProcess, metric, wait_metric
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

from bootstrap.cli.main import main
from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.requests import request_rows

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traced")
    checkpoint = save_checkpoint("llama", tmp / "llama", CHAT_TEMPLATE)
    server = ServeProcess(
        tmp / "serve.log", "--model", str(checkpoint), "--no-plan-cache", "--trace-file", str(tmp / "trace.jsonl")
    )
    server.wait_state("ready")
    yield server, checkpoint, tmp / "trace.jsonl"
    server.stop()


def spans_of(path: Path, trace_id: str, count: int, timeout: float = 30.0) -> list[dict]:
    """The trace's spans once ``count`` of them are in the file (the request span ends after its last byte)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = [json.loads(line) for line in path.read_text().splitlines() if trace_id in line]
        spans = [s for s in spans if s["trace_id"] == trace_id]
        if len(spans) >= count:
            return spans
        time.sleep(0.05)
    raise TimeoutError(f"{count} spans of trace {trace_id} never reached {path}: {spans}")


def one_span(spans: list[dict], name: str) -> dict:
    [span] = [s for s in spans if s["name"] == name]
    return span


def test_a_streamed_chat_request_continues_the_callers_trace(traced):
    server, checkpoint, path = traced
    body = {
        "model": str(checkpoint),
        "messages": [{"role": "user", "content": "w33 w44 w55"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        named = reply.headers["traceparent"]
    usage = chunks[-1]["usage"]
    spans = spans_of(path, CALLER_TRACE, 5)
    request, choice = one_span(spans, "bootstrap.request"), one_span(spans, "bootstrap.request.choice")
    queue, prefill, decode = (one_span(spans, f"bootstrap.request.{p}") for p in ("queue", "prefill", "decode"))
    assert named == f"00-{CALLER_TRACE}-{request['span_id']}-01" and request["parent_span_id"] == CALLER_SPAN
    assert choice["parent_span_id"] == request["span_id"]
    assert {queue["parent_span_id"], prefill["parent_span_id"], decode["parent_span_id"]} == {choice["span_id"]}
    # end to end, inside the request: queue, then prefill, then decode
    assert request["start_time_unix_nano"] <= queue["start_time_unix_nano"] == choice["start_time_unix_nano"]
    assert queue["end_time_unix_nano"] == prefill["start_time_unix_nano"]
    assert prefill["end_time_unix_nano"] == decode["start_time_unix_nano"]
    assert decode["end_time_unix_nano"] == choice["end_time_unix_nano"] <= request["end_time_unix_nano"]
    attrs = request["attributes"]
    assert attrs["http.response.status_code"] == 200 and attrs["bootstrap.endpoint"] == "chat"
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == decode["attributes"]["bootstrap.tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == [chunks[-2]["choices"][0]["finish_reason"]]
    assert prefill["attributes"] == {"bootstrap.tokens": usage["prompt_tokens"], "bootstrap.steps": 1}
    tpb = httpx.get(f"{server.url}/v1/bootstrap").json()["plan"]["tokens_per_block"]
    kv_tokens = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert choice["attributes"]["bootstrap.kv_blocks"] == -(-kv_tokens // tpb)


def test_choices_are_a_span_each_and_a_refused_body_is_a_traced_400(traced):
    server, checkpoint, path = traced
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": str(checkpoint), "prompt": "w5 w6", "max_tokens": 3, "n": 3, "temperature": 1.0, "seed": 3},
        timeout=60,
    )
    trace_id = reply.headers["traceparent"].split("-")[1]
    spans = spans_of(path, trace_id, 1 + 3 * 4)
    choices = sorted(
        (s for s in spans if s["name"] == "bootstrap.request.choice"), key=lambda s: s["attributes"]["bootstrap.choice"]
    )
    assert [c["attributes"]["bootstrap.choice"] for c in choices] == [0, 1, 2]
    assert len({c["attributes"]["bootstrap.request_id"] for c in choices}) == 3
    assert one_span(spans, "bootstrap.request")["attributes"]["bootstrap.choices"] == 3
    refused = httpx.post(
        f"{server.url}/v1/completions", json={"model": str(checkpoint), "prompt": "w5", "max_tokens": -1}
    )
    assert refused.status_code == 400
    [request] = spans_of(path, refused.headers["traceparent"].split("-")[1], 1)
    assert request["attributes"]["http.response.status_code"] == 400 and request["status"] == "UNSET"
    assert "bootstrap.choices" not in request["attributes"]  # refused before anything was enqueued


def test_bootstrap_trace_lists_the_requests_slowest_first(traced, capsys, monkeypatch):
    server, checkpoint, path = traced
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for every column of both tables
    for tokens in (1, 12, 4):
        httpx.post(
            f"{server.url}/v1/completions",
            json={"model": str(checkpoint), "prompt": "w9 w10", "max_tokens": tokens, "temperature": 0},
            timeout=60,
        )
    time.sleep(0.5)  # the last request's span ends after its last byte
    rows = request_rows(read_spans(path))
    assert len(rows) >= 3 and [r.duration_s for r in rows] == sorted((r.duration_s for r in rows), reverse=True)
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"requests, slowest first ({min(20, len(rows))} of {len(rows)}" in out
    assert "final_build" in out and rows[0].trace_id in out  # the stages' timeline, then the requests
    assert main(["trace", str(path), "--requests", "0"]) == 0 and "slowest first" not in capsys.readouterr().out


def test_requests_cut_at_random_points_each_end_one_span_and_leave_nothing_behind(traced):
    """Streams closed by their client after 0 to 3 chunks, or read to the end, all at once: every
    request still has exactly one request span and one choice span, ended, with how it ended;
    the engine holds no block and the server no request afterwards."""
    server, checkpoint, path = traced
    rng = random.Random(23)
    plan = [(f"{rng.getrandbits(128):032x}", rng.choice([None, 0, 1, 3])) for _ in range(24)]
    answered = httpx.get(f"{server.url}/v1/engine").json()["requests_answered"]

    async def one(http: httpx.AsyncClient, trace_id: str, cut: int | None) -> None:
        body = {
            "model": str(checkpoint),
            "prompt": "w5 w6 w7",
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        headers = {"traceparent": f"00-{trace_id}-{rng.getrandbits(64):016x}-01"}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
            chunks = 0
            async for line in reply.aiter_lines():
                chunks += line.startswith("data: {")
                if cut is not None and chunks > cut:
                    break  # leaving the block closes the connection mid-stream

    async def all_at_once() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await asyncio.gather(*(one(http, trace_id, cut) for trace_id, cut in plan))

    asyncio.run(all_at_once())
    wait_metric(server, "bootstrap_requests_in_flight", 0)
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "bootstrap_kv_blocks_used") == 0 and metric(page, "bootstrap_requests_running") == 0
    for trace_id, cut in plan:
        spans = spans_of(path, trace_id, 5)
        request, choice = one_span(spans, "bootstrap.request"), one_span(spans, "bootstrap.request.choice")
        reason = choice["attributes"]["bootstrap.finish_reason"]
        assert request["attributes"]["gen_ai.response.finish_reasons"] == [reason]
        assert reason == "length" if cut is None else reason in ("abort", "length"), (cut, reason)
        assert choice["end_time_unix_nano"] <= request["end_time_unix_nano"]
    status = httpx.get(f"{server.url}/v1/engine").json()
    assert status["requests_answered"] == answered + len(plan) and status["in_flight"] == 0
    slowest = [r["total_s"] for r in status["slowest"]]
    assert slowest == sorted(slowest, reverse=True) and status["engine"]["kv_used_blocks"] == 0
