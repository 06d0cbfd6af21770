"""``bootstrap trace`` of a real served start with requests, beside a start whose profiling was
retried (``plan --fault``), read as the terminal shows it at ``COLUMNS`` 80 (the width when
piped) and 200: no line wider than the terminal, no word cut or ellipsized, every note whole
(issue 56, item 2)."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.serve_process import ServeProcess

from bootstrap.cli.main import main
from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.requests import request_rows
from bootstrap.cli.trace.timeline import timeline


@pytest.fixture(scope="module")
def traces(checkpoint, tmp_path_factory) -> list:
    tmp = tmp_path_factory.mktemp("served")
    served, retried = tmp / "serve.jsonl", tmp / "retried.jsonl"
    server = ServeProcess(tmp / "serve.log", "--model", str(checkpoint), "--no-plan-cache", "--trace-file", str(served))
    try:
        server.wait_state("ready")
        for n in (1, 2, 1):
            body = {"model": str(checkpoint), "prompt": "w5 w37 w33", "max_tokens": 6, "n": n, "temperature": 0}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        chat = {"model": str(checkpoint), "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        assert server.signal() == 0
    finally:
        server.stop()
    plan = ["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--fault", "profiling:oom:2", "--json"]
    assert main([*plan, "--trace-file", str(retried)]) == 0
    return [served, retried]


def shown(columns: int, files: list, monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    capsys.readouterr()
    assert main(["trace", *map(str, files)]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("columns", [80, 200])
def test_no_line_is_wider_than_the_terminal_and_no_word_is_cut(columns, traces, monkeypatch, capsys):
    out = shown(columns, traces, monkeypatch, capsys)
    assert max(len(line) for line in out.splitlines()) <= columns
    assert "…" not in out
    words = set(out.split())
    for path in traces:
        spans = read_spans(path)
        for bar in timeline(spans).bars:
            assert set(bar.note.split()) <= words, bar.note
        for row in request_rows(spans):
            assert {row.endpoint, row.status, *row.finish.split()} <= words, row
    assert "length, length" in out  # the request with n=2: each choice's reason, wrapped at most at the space


def test_at_80_columns_a_retry_s_error_is_written_out_whole_under_the_table(traces, monkeypatch, capsys):
    out = shown(80, traces, monkeypatch, capsys)
    spans = [json.loads(line) for line in traces[1].read_text().splitlines()]
    attempt = next(s for s in spans if s["name"].endswith(".attempt") and s["attributes"]["bootstrap.attempt"] == 2)
    error = attempt["events"][0]["attributes"]["exception.message"]
    assert len(error) > 100  # longer than the 100 characters a note was once cut to
    flowing = " ".join(out.split())
    assert f"attempt 2: probe_tokens: 132096 -> 2080; ProbeOutOfMemory: {error}" in flowing
    header = next(line for line in out.splitlines() if "request" in line and "total" in line)
    assert all(f" {column} " in header for column in ("total", "queue", "prefill", "decode", "tokens", "finish"))
    assert all(line == line.rstrip() for line in out.splitlines() if line.startswith("["))
