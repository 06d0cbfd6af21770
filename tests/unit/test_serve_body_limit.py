"""One request must not freeze the server (issue 20, item 2): the real app, in process, with a
ready state whose tokenizer is slow or counts its calls. Bodies over ``MAX_BODY_BYTES`` are a 413
before any parsing (declared or chunked); text too long for ``max_seq_len`` under any tokenizer is
refused before tokenizing; tokenizing and the chat template run off the event loop."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import anyio
import httpx
import pytest

from bootstrap.config import BootstrapConfig
from bootstrap.serve.app import create_app
from bootstrap.serve.body_limit import MAX_BODY_BYTES
from bootstrap.serve.openai.inputs import MAX_CHARS_PER_TOKEN
from bootstrap.serve.state import ServeOptions, ServeState

MAX_SEQ_LEN = 32768
TOKENIZE_S = 1.0


class SlowTokenizer:
    """Blocks its thread ``TOKENIZE_S`` per call, as a multi-megabyte prompt does; counts calls."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.started, self.ended, self.calls = threading.Event(), threading.Event(), 0

    def _work(self) -> list[int]:
        self.calls += 1
        self.started.set()
        time.sleep(TOKENIZE_S)
        self.ended.set()
        return [5] * 10

    def __call__(self, text: str) -> dict:
        return {"input_ids": self._work()}

    def apply_chat_template(self, messages: list, **kwargs: object) -> list[int]:
        return self._work()


def _not_taking(ids: list[int], params: object) -> int:
    raise RuntimeError("test executor takes no requests")


def client(tokenizer: SlowTokenizer | None = None, phase: str = "ready") -> httpx.AsyncClient:
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m"), phase=phase, max_seq_len=MAX_SEQ_LEN)
    # 503 once past tokenizing; an engine that never went silent, for /health
    state.executor = SimpleNamespace(tokenizer=tokenizer, enqueue=_not_taking, silent_s=lambda: (0.0, 0))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://serve")


def body(route: str, text: str) -> dict:
    if route == "/v1/completions":
        return {"model": "m", "prompt": text, "max_tokens": 4}
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


ROUTES = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("route", ROUTES)
async def test_health_answers_within_100_ms_while_a_large_prompt_is_tokenized(route):
    tokenizer = SlowTokenizer()
    text = "w5 " * (4 * 1024 * 1024 // 3)  # 4 MiB: under the body limit and max_seq_len's character bound
    async with client(tokenizer) as http, anyio.create_task_group() as tg:
        answers: dict[str, httpx.Response] = {}

        async def post() -> None:
            answers["post"] = await http.post(route, json=body(route, text))

        tg.start_soon(post)
        with anyio.fail_after(10):
            # the loop must be free to see it while it runs (ASYNC110: a thread's Event, polled on purpose)
            while not tokenizer.started.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.005)
        sent = time.monotonic()
        health = await http.get("/health")
        took = time.monotonic() - sent
        still_tokenizing = not tokenizer.ended.is_set()
    assert health.status_code == 200 and took < 0.1, f"/health took {took * 1000:.0f} ms"
    assert still_tokenizing, "/health was answered only after the tokenizer was done"
    assert answers["post"].status_code == 503 and "takes no requests" in answers["post"].json()["error"]["message"]


def _assert_413(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert response.status_code == 413, response.text
    assert (
        error["type"] == "invalid_request_error" and error["param"] == "body" and error["code"] == "request_too_large"
    )
    assert f"at most {MAX_BODY_BYTES} bytes" in error["message"]


@pytest.mark.parametrize("route", ROUTES)
async def test_a_body_over_the_limit_is_a_413_naming_it_before_any_parsing(route):
    tokenizer = SlowTokenizer()
    content = json.dumps(body(route, "w5 " * (MAX_BODY_BYTES // 3 + 1))).encode()
    async with client(tokenizer) as http:
        _assert_413(await http.post(route, content=content, headers={"content-type": "application/json"}))
    assert tokenizer.calls == 0


@pytest.mark.parametrize("route", ROUTES)
async def test_a_chunked_body_over_the_limit_is_a_413_too(route):
    tokenizer = SlowTokenizer()
    content = json.dumps(body(route, "w5 " * (MAX_BODY_BYTES // 3 + 1))).encode()

    async def chunks():  # no Content-Length: only counting the body as it arrives can stop it
        for start in range(0, len(content), 64 * 1024):
            yield content[start : start + 64 * 1024]

    async with client(tokenizer) as http:
        response = await http.post(route, content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers
        _assert_413(response)
    assert tokenizer.calls == 0


@pytest.mark.parametrize("route, param", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
async def test_text_too_long_for_any_tokenizer_is_refused_before_tokenizing(route, param):
    tokenizer = SlowTokenizer()
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m"), phase="ready", max_seq_len=64)
    state.executor = SimpleNamespace(tokenizer=tokenizer, enqueue=_not_taking, silent_s=lambda: (0.0, 0))
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://serve") as http:
        response = await http.post(route, json=body(route, "x" * (64 * MAX_CHARS_PER_TOKEN + 1)))
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param
    assert (
        f"allowed: at most {64 * MAX_CHARS_PER_TOKEN} characters" in error["message"]
        and "max_seq_len (64)" in error["message"]
    )
    assert tokenizer.calls == 0
