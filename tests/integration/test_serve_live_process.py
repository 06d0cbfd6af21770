"""The live operations of a real ``bootstrap serve`` process on the CPU: ``--idle`` takes its model
from a swap; a SIGTERM while a swap drains a stream ends the stream with ``abort``, the swap
with a 503, and the process with status 0 and no traceback."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import anyio
import httpx
from helpers.live_serve import PROMPT, TOKENS
from helpers.serve_backends import plugin_module
from helpers.serve_process import ServeProcess, metric

from bootstrap.api import Bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.engine.sampling.sampler import SamplingParams

EXIT_BOUND_S = 60  # a clean exit takes a few seconds; the drain it interrupts would take far longer


def fresh_tokens(model: Path) -> list[int]:
    """Greedy token ids of a fresh ``Bootstrap`` on ``model``."""

    async def run() -> list[int]:
        boot = Bootstrap(BootstrapConfig(model=str(model), device="cpu", max_num_tokens=64, max_batch_size=4))
        try:
            executor = await boot.build()
            rid = executor.enqueue(PROMPT, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
            return list(executor.await_response(rid, 60).token_ids)
        finally:
            await boot.aclose()

    return anyio.run(run)


def post(server: ServeProcess, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=EXIT_BOUND_S)


def test_an_idle_server_answers_once_a_swap_gives_it_a_model(llama, tmp_path):
    expected = fresh_tokens(llama)
    server = ServeProcess(tmp_path / "serve.log", "--idle", "--no-plan-cache")
    try:
        server.wait_state("idle")
        ready = httpx.get(f"{server.url}/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "idle" and "Retry-After" in ready.headers
        refused = post(server, "/v1/completions", {"model": "any", "prompt": PROMPT})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "idle"
        assert "Retry-After" in refused.headers and "/v1/bootstrap/swap" in refused.json()["error"]["message"]
        assert post(server, "/v1/bootstrap/weights", {"path": str(llama)}).status_code == 409
        swap = {"model": str(llama), "served_model_name": "tiny", "max_num_tokens": 64, "max_batch_size": 4}
        swapped = post(server, "/v1/bootstrap/swap", swap)
        assert swapped.status_code == 200 and swapped.json()["state"] == "ready", swapped.text
        assert httpx.get(f"{server.url}/ready").status_code == 200
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["tiny"]
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        answer = post(server, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        assert [int(word[1:]) for word in answer.json()["choices"][0]["text"].split()] == expected
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()


def _read(url: str, body: dict, out: list[str]) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            out.extend(line for line in response.iter_lines() if line)
    except httpx.HTTPError as exc:  # the stream broke instead of ending
        out.append(f"broken: {exc!r}")


def _post_into(url: str, body: dict, out: list[httpx.Response | str]) -> None:
    try:
        out.append(httpx.post(f"{url}/v1/bootstrap/swap", json=body, timeout=120))
    except httpx.HTTPError as exc:
        out.append(f"broken: {exc!r}")


def _wait_in_flight(server: ServeProcess, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(httpx.get(f"{server.url}/metrics").text, "bootstrap_requests_in_flight") == count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{count} requests never were in flight:\n{server.log()}")


def test_sigterm_while_a_swap_drains_exits_0_and_ends_the_stream(llama, qwen, tmp_path):
    backend = plugin_module(tmp_path, step_delay_s=0.1)  # 400 tokens: 40 s and more, far past the signal
    argv = ("--model", str(llama), "--no-plan-cache", "--backend-factory", backend)
    times = ("--drain-timeout", "600", "--shutdown-timeout", "1")
    server = ServeProcess(tmp_path / "serve.log", *argv, *times, pythonpath=(tmp_path,))
    stream: list[str] = []
    swap: list[httpx.Response | str] = []
    try:
        server.wait_state("ready")
        body = {"model": str(llama), "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
        reader = threading.Thread(target=_read, args=(server.url, body, stream))
        reader.start()
        _wait_in_flight(server, 1)
        swapper = threading.Thread(target=_post_into, args=(server.url, {"model": str(qwen)}, swap))
        swapper.start()
        server.wait_state("swapping")  # checked; now waiting for the stream
        status = server.signal(signal.SIGTERM, timeout=EXIT_BOUND_S)
        reader.join(EXIT_BOUND_S)
        swapper.join(EXIT_BOUND_S)
    finally:
        server.stop()
    log = server.log()
    assert status == 0, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    chunks = [json.loads(line[6:]) for line in stream if line.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert [r for r in reasons if r] == ["abort"] and stream[-1] == "data: [DONE]", stream[-3:]
    assert 0 < len(chunks) - 1 < 400  # its partial output, then the final chunk
    assert len(swap) == 1 and not isinstance(swap[0], str), swap
    assert swap[0].status_code == 503 and swap[0].json()["error"]["code"] == "shutting_down", swap[0].text
    assert "no thread left" in log and "threads still alive" not in log, log
