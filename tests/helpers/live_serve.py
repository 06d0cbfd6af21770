"""The live operations' tests over HTTP (``tests/integration/test_serve_live*.py``): the app in
process (its lifespan run here, httpx over ASGI) on tiny checkpoints, a request held in flight
without any timing (``Hold``), and streams read as the app sends them (``Stream``: httpx's ASGI
transport hands a body over only once it is complete)."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import torch
from fastapi import FastAPI
from safetensors.torch import load_file, save_file

from bootstrap.config import BootstrapConfig
from bootstrap.serve.app import create_app
from bootstrap.serve.state import ServeOptions, ServeState
from helpers.serve_process import metric

PROMPT = [5, 37, 33, 9, 64, 42, 7]  # token ids: the qwen2 checkpoint's tokenizer reads no "w" words
TOKENS = 12
BOUND_S = 120  # what no wait here may exceed; none is expected to come near it


async def fresh_answers(checkpoints: dict[str, Path]) -> dict[str, str]:
    """The greedy answer of a fresh server on each checkpoint."""
    found = {}
    for name, path in checkpoints.items():
        async with serving(path) as server:
            found[name] = await server.text()
    return found


def perturbed(source: Path, target: Path, reshape: str | None = None) -> Path:
    """``source`` with every matrix shifted by seeded noise; ``reshape``: that tensor one row short."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if tensor.dim() > 1:
            tensors[name] = tensor + 0.5 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    if reshape is not None:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


# ---- a server in process ------------------------------------------------------------------------


@dataclass
class Server:
    app: FastAPI
    state: ServeState
    http: httpx.AsyncClient

    def completion(self, model: str | None = None, **extra) -> dict:
        body = {"model": model or self.state.model_id, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        return {**body, "ignore_eos": True, **extra}

    async def complete(self, model: str | None = None) -> httpx.Response:
        return await self.http.post("/v1/completions", json=self.completion(model))

    async def text(self, model: str | None = None) -> str:
        response = await self.complete(model)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def op(self, path: str, body: dict | None = None) -> httpx.Response:
        return await self.http.post(path, json=body)


@contextlib.asynccontextmanager
async def serving(model: Path, **options) -> AsyncIterator[Server]:
    """The app on ``model`` (``options``: ``ServeOptions``' fields) with its lifespan running, once ready."""
    config = BootstrapConfig(model=str(model), device="cpu", max_num_tokens=64, max_batch_size=4)
    state = ServeState(config, ServeOptions(**{"model_id": str(model), **options}))
    app = create_app(state)
    async with app.router.lifespan_context(app):
        await settled(state, "ready", "idle")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            yield Server(app, state, http)


async def settled(state: ServeState, *phases: str) -> None:
    """Wait for one of ``phases`` (woken by each change, never polled); fail on another end."""
    with anyio.fail_after(BOUND_S):
        while True:
            change = state.changes.next()  # taken before reading: a change after the read wakes us
            if state.phase in phases:
                return
            assert state.phase != "failed" or "failed" in phases, state.error
            await change.wait()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


class Hold:
    """The executor's forwards after its first ``passing`` wait for ``release`` (or, with
    ``until_cancel``, for the first cancel the server sends it): a request stays in flight,
    mid-answer, for as long as the test needs."""

    def __init__(self, executor, passing: int = 1, until_cancel: bool = False) -> None:
        self.free = threading.Event()
        run, cancel, left = executor.runner.run, executor.cancel, [passing]

        def held(batch, *args):
            if left[0]:
                left[0] -= 1
            else:
                self.free.wait(BOUND_S)
            return run(batch, *args)

        def cancel_then_release(*args, **kwargs):
            cancel(*args, **kwargs)
            self.free.set()

        executor.runner.run = held
        if until_cancel:
            executor.cancel = cancel_then_release

    def release(self) -> None:
        self.free.set()


class Stream:
    """A streaming ``POST /v1/completions`` straight to the ASGI app: its SSE payloads as sent."""

    def __init__(self, app: FastAPI, body: dict) -> None:
        self.app, self._body = app, json.dumps({**body, "stream": True}).encode()
        self._send, self._events = anyio.create_memory_object_stream[str](1000)
        self._buffer = ""
        self.status: int | None = None

    async def run(self) -> None:
        headers = [(b"host", b"localhost"), (b"content-type", b"application/json")]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [*headers, (b"content-length", str(len(self._body)).encode())],
            "server": ("localhost", 80),
            "client": ("127.0.0.1", 5000),
        }
        async with self._send:
            await self.app(scope, self._receive, self._on_send)

    async def _receive(self) -> dict:
        if self._body:
            body, self._body = self._body, b""
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # the client stays
        raise AssertionError("unreachable")

    async def _on_send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        self._buffer += message.get("body", b"").decode()
        while "\n\n" in self._buffer:
            event, _, self._buffer = self._buffer.partition("\n\n")
            await self._send.send(event.removeprefix("data: "))

    async def next_chunk(self) -> dict:
        with anyio.fail_after(BOUND_S):
            return json.loads(await self._events.receive())

    async def rest(self) -> list[str]:
        with anyio.fail_after(BOUND_S):
            return [event async for event in self._events]


def text_and_finish(chunks: list[dict]) -> tuple[str, str | None]:
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    return "".join(c["text"] for c in choices), next((c["finish_reason"] for c in choices if c["finish_reason"]), None)


async def in_flight(server: Server, old_executor) -> tuple[int, ...]:
    """What is still counted in flight: the server's requests, its metric, the served engine's
    running requests, and the old executor's running and waiting requests and KV blocks."""
    page = (await server.http.get("/metrics")).text
    engine = (await server.http.get("/v1/engine")).json()
    old = old_executor.engine_stats()  # published by its shutdown
    served = (len(server.state.inflight), int(metric(page, "bootstrap_requests_in_flight")), engine["in_flight"])
    return (*served, engine["engine"]["running"], old.running, old.waiting, old.kv_used_blocks)
