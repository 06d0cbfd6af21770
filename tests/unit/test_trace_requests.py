"""``bootstrap trace``'s request view (``bootstrap.cli.trace.requests``) on spans written by hand
in the trace file's shape: the slowest request first, its slowest choice's phases, the refused
request without any, and attributes of the wrong type shown as ``?`` instead of failing."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from bootstrap.cli.trace.requests import fitted_requests_table, request_rows, requests_table

MS = 1_000_000


def span(name, span_id, parent, start_ms, end_ms, **attributes):
    return {
        "name": name,
        "trace_id": f"{span_id:0>32}",
        "span_id": span_id,
        "parent_span_id": parent,
        "start_time_unix_nano": start_ms * MS,
        "end_time_unix_nano": end_ms * MS,
        "status": "UNSET",
        "attributes": attributes,
        "events": [],
    }


def traced_request(rid, start, choices):
    spans = [
        span(
            "bootstrap.request",
            rid,
            None,
            start,
            start + 100,
            **{
                "bootstrap.endpoint": "chat",
                "http.response.status_code": 200,
                "gen_ai.usage.input_tokens": 7,
                "gen_ai.usage.output_tokens": 9,
                "gen_ai.response.finish_reasons": ["length"] * len(choices),
            },
        )
    ]
    for index, (queue, prefill, decode) in enumerate(choices):
        cid = f"{rid}c{index}"
        begin = start + 5
        spans += [
            span(
                "bootstrap.request.choice",
                cid,
                rid,
                begin,
                begin + queue + prefill + decode,
                **{"bootstrap.kv_blocks": 3},
            ),
            span("bootstrap.request.queue", f"{cid}q", cid, begin, begin + queue),
            span("bootstrap.request.prefill", f"{cid}p", cid, begin + queue, begin + queue + prefill),
            span("bootstrap.request.decode", f"{cid}d", cid, begin + queue + prefill, begin + queue + prefill + decode),
        ]
    return spans


def test_rows_come_slowest_first_with_the_slowest_choices_phases():
    fast = traced_request("a1", 0, [(1, 2, 3)])
    slow = traced_request("b2", 50, [(1, 2, 3), (10, 20, 30)])
    slow[0]["end_time_unix_nano"] = 400 * MS
    refused = [
        span(
            "bootstrap.request", "c3", None, 60, 62, **{"url.path": "/v1/completions", "http.response.status_code": 400}
        )
    ]
    stage = [span("bootstrap.stage.load_model", "d4", None, 0, 10)]
    rows = request_rows([*fast, *stage, *refused, *slow])
    assert [r.trace_id for r in rows] == ["00000000", "00000000", "00000000"] and len(rows) == 3
    first, second, third = rows
    assert first.duration_s == pytest.approx(0.35) and first.phases["queue"] == pytest.approx((0.055, 0.065))
    assert first.phases["decode"] == pytest.approx((0.085, 0.115)) and first.kv_blocks == "3+3"  # choice 1: the slower
    assert first.finish == "length, length" and second.duration_s == pytest.approx(0.1) and second.tokens == "7→9"
    assert third.status == "400" and third.endpoint == "/v1/completions" and third.phases == {}


def test_attributes_of_the_wrong_type_show_as_a_question_mark():
    spans = traced_request("e5", 0, [(1, 1, 1)])
    spans[0]["attributes"].update(
        {
            "gen_ai.usage.output_tokens": {"a": 1},
            "gen_ai.response.finish_reasons": "oops",
            "http.response.status_code": True,
        }
    )
    [row] = request_rows(spans)
    assert (row.tokens, row.finish, row.status) == ("7→?", "?", "?")
    console = Console(width=200, record=True)
    console.print(requests_table([row], shown=5, width=20))
    text = console.export_text()
    assert "requests, slowest first (1 of 1" in text and "7→?" in text
    json.dumps(spans)  # still the file's shape


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_request_table_fits_the_console_with_every_header_and_value_whole(width):
    rows = request_rows([*traced_request("a1", 0, [(10, 20, 60)]), *traced_request("b2", 50, [(5, 10, 30)])])
    console = Console(width=width, record=True)
    console.print(fitted_requests_table(rows, 20, width))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "start" in line)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    for column in ("request", "start", "total", "queue", "prefill", "decode", "tokens", "finish"):
        assert f" {column} " in header
    assert ("timeline" in header and "00000000" in text) == (width == 200)  # the bar goes first, then the trace id
