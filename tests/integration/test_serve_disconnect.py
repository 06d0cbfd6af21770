"""A client that hangs up at any point (queued, mid-stream, waiting for a whole answer) cancels
every choice of its request: the engine's running and waiting requests, its KV blocks and the
server's in-flight count all come back to where they were (issue 36, item 9). A real server on
the CPU whose every step sleeps 100 ms, at most two sequences at once, and raw sockets, so the
test decides the moment each client goes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
import pytest
from helpers.serve_backends import plugin_module
from helpers.serve_process import ServeProcess, metric
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

PROMPT = "w5 w37 w33 w9 w64 w42 w7"
LONG = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0}  # 40 s and more at 100 ms a step


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disconnect")
    checkpoint = save_checkpoint("llama", tmp / "llama", CHAT_TEMPLATE)
    backend = plugin_module(tmp, step_delay_s=0.1)
    argv = ("--model", str(checkpoint), "--no-plan-cache", "--backend-factory", backend, "--max-batch-size", "2")
    server = ServeProcess(tmp / "serve.log", *argv, pythonpath=(tmp,))
    server.wait_state("ready")
    yield server, str(checkpoint)
    server.stop()


def post(server: ServeProcess, body: dict) -> socket.socket:
    """A raw ``POST /v1/completions``: the test closes the socket when it wants the client gone."""
    address = server.url.removeprefix("http://")
    host, port = address.split(":")
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_engine(server: ServeProcess, done: Callable[[dict], bool], timeout: float = 30.0) -> dict:
    """Poll ``/v1/engine`` until ``done`` holds for it (bounded by ``timeout``); return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"{server.url}/v1/engine", timeout=10).json()
        flat = {**body["engine"], "in_flight": body["in_flight"], "tokens": body["tokens_generated"]}
        if done(flat):
            return flat
        time.sleep(0.05)
    raise TimeoutError(f"/v1/engine never got there; last: {flat}")


def idle(e: dict) -> bool:
    return e["in_flight"] == e["running"] == e["waiting"] == e["kv_used_blocks"] == 0


def assert_idle(server: ServeProcess) -> None:
    wait_engine(server, idle)
    page = httpx.get(f"{server.url}/metrics").text
    assert metric(page, "bootstrap_requests_in_flight") == metric(page, "bootstrap_kv_blocks_used") == 0


def test_clients_gone_while_queued_and_mid_stream_leave_nothing_behind(busy):
    server, model = busy
    wait_engine(server, idle)
    both = post(server, {"model": model, **LONG, "n": 2, "stream": True})  # two choices: the whole batch
    wait_engine(server, lambda e: e["running"] == 2)
    queued = [post(server, {"model": model, **LONG, "stream": stream}) for stream in (True, False)]
    wait_engine(server, lambda e: e["waiting"] == 2 and e["in_flight"] == 4)
    for sock in queued:  # before their first token
        sock.close()
    wait_engine(server, lambda e: e["waiting"] == 0 and e["in_flight"] == 2 and e["running"] == 2)
    received = b""
    while b"data: " not in received:  # its first tokens: now hang up mid-stream
        received += both.recv(4096)
    both.close()
    assert_idle(server)


def test_a_client_gone_while_waiting_for_a_whole_answer_leaves_nothing_behind(busy):
    server, model = busy
    before = wait_engine(server, idle)
    whole = post(server, {"model": model, **LONG})
    wait_engine(server, lambda e: e["running"] == 1 and e["tokens"] > before["tokens"])  # generating
    whole.close()
    assert_idle(server)
