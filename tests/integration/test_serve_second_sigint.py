"""A second SIGINT while streams are in flight: the server exits at once (not after the grace
period), with status 0, every stream ended (a final ``cancelled`` chunk, then ``[DONE]``), and
no traceback in its log (issue 20, item 13)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.serve_backends import plugin_module
from helpers.serve_process import ServeProcess, metric
from helpers.tiny_models import save_checkpoint

PROMPT = "w5 w37 w33 w9 w64 w42 w7"
STREAMS = 3
GRACE_S = 60  # far longer than the test may take: only the second SIGINT can end it in time


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return save_checkpoint("llama", tmp_path / "llama")


def _read(url: str, body: dict, out: list[str]) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            out.extend(line for line in response.iter_lines() if line)
    except httpx.HTTPError as exc:  # the stream broke instead of ending
        out.append(f"broken: {exc!r}")


def _wait_in_flight(server: ServeProcess, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(httpx.get(f"{server.url}/metrics").text, "bootstrap_requests_in_flight") == count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{count} requests never were in flight:\n{server.log()}")


def _finish(lines: list[str]) -> str | None:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return next((r for r in reasons if r), None)


def test_a_second_sigint_ends_streams_and_exits_0_without_tracebacks(checkpoint, tmp_path):
    backend = plugin_module(tmp_path, step_delay_s=0.1)  # 400 tokens: 40 s and more per request
    server = ServeProcess(
        tmp_path / "serve.log",
        "--model",
        str(checkpoint),
        "--no-plan-cache",
        "--backend-factory",
        backend,
        "--shutdown-timeout",
        str(GRACE_S),
        pythonpath=(tmp_path,),
    )
    try:
        server.wait_state("ready")
        body = {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
        results: list[list[str]] = [[] for _ in range(STREAMS)]
        threads = [threading.Thread(target=_read, args=(server.url, body, out)) for out in results]
        for thread in threads:
            thread.start()
        _wait_in_flight(server, STREAMS)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # the first one is draining: the grace period runs
        started = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        status = server.proc.wait(30)
        took = time.monotonic() - started
        for thread in threads:
            thread.join(30)
    finally:
        server.stop()
    log = server.log()
    assert status == 0, log
    print(f"second SIGINT -> exit {status} in {took:.2f} s")
    assert took < 15, f"the second SIGINT took {took:.1f} s to end the server\n{log}"
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert [_finish(lines) for lines in results] == ["abort"] * STREAMS, (results, log)
    assert all(lines[-1] == "data: [DONE]" for lines in results), results
