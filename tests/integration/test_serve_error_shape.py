"""No answer outside OpenAI's shape or outside JSON (issue 54, defect 7, serve side): a model that
rules tokens out (their logprob -inf) answers ``logprobs`` with -9999.0, as vLLM does, whole and
streamed; an exception no route answers is a 500 ``server_error`` that names nothing of the
server's insides (its traceback in the log), and a stream it cuts short ends with that error as
an event, then ``[DONE]``."""

from __future__ import annotations

import json
import logging

import anyio
import pytest
from fastapi.responses import JSONResponse, StreamingResponse
from helpers.broken_checkpoints import copy_checkpoint, ruling_out
from helpers.live_serve import Stream, error_of, serving

from bootstrap.serve.errors import INTERNAL
from bootstrap.serve.openai.logprobs import FLOOR

KEPT = (7, 9)  # the tokens the model leaves possible: each has logprob log(1/2)
HALF = -0.6931


def strict_json(text: str):
    """``text`` as JSON that any client parses: NaN and Infinity refused (``json.loads`` takes them)."""

    def refuse(constant: str):
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def ruling(checkpoint, tmp_path_factory):
    path = copy_checkpoint(checkpoint, tmp_path_factory.mktemp("ruling") / "ruling")
    ruling_out(path, KEPT)
    return path


def _check_top(top: dict[str, float]) -> None:
    """Three alternatives: the two kept tokens at log(1/2) and one ruled out, at ``FLOOR``."""
    assert sorted(top.values()) == pytest.approx([FLOOR, HALF, HALF], abs=1e-3), top
    assert {t for t, v in top.items() if v > FLOOR} == {f"w{i}" for i in KEPT}, top


async def test_logprobs_of_ruled_out_tokens_are_the_floor_in_valid_json(ruling):
    async with serving(ruling) as server:
        body = server.completion(logprobs=3, max_tokens=3)
        whole = await server.http.post("/v1/completions", json=body)
        chat = await server.http.post(
            "/v1/chat/completions",
            json={
                "model": server.state.model_id,
                "messages": [{"role": "user", "content": "w9 w64"}],
                "max_tokens": 2,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 3,
            },
        )
        stream = Stream(server.app, body)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.run)
            events = await stream.rest()
    assert whole.status_code == 200, whole.text
    logprobs = strict_json(whole.text)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx([HALF] * 3, abs=1e-3)
    for top in logprobs["top_logprobs"]:
        _check_top(top)
    assert chat.status_code == 200, chat.text
    for entry in strict_json(chat.text)["choices"][0]["logprobs"]["content"]:
        assert entry["logprob"] == pytest.approx(HALF, abs=1e-3)
        _check_top({t["token"]: t["logprob"] for t in entry["top_logprobs"]})
    assert stream.status == 200 and events[-1] == "[DONE]", events
    streamed = [c["choices"][0]["logprobs"] for c in map(strict_json, events[:-1]) if c["choices"][0]["logprobs"]]
    assert len(streamed) == 3
    for piece in streamed:
        _check_top(piece["top_logprobs"][0])


def _raising(app) -> None:
    """Routes of the test's own on the real app, failing as the defect did: starlette's JSON
    refuses an infinite float (``ValueError: Out of range float values``), whole or mid-stream."""

    @app.get("/test/whole")
    async def whole() -> JSONResponse:
        return JSONResponse({"logprob": float("-inf")})

    @app.get("/test/stream")
    async def stream() -> StreamingResponse:
        async def body():
            yield "data: {}\n\n"
            yield f"data: {json.dumps({'logprob': float('-inf')}, allow_nan=False)}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


async def test_an_exception_no_route_answered_is_openais_500_and_its_traceback_is_logged(llama, caplog):
    caplog.set_level(logging.ERROR, logger="bootstrap.serve")
    async with serving(llama) as server:
        _raising(server.app)
        whole = await server.http.get("/test/whole")
        streamed = await server.http.get("/test/stream")
        after = await server.complete()
    error = error_of(whole, 500)
    assert error == {"message": INTERNAL, "type": "server_error", "param": None, "code": "internal_error"}
    assert "Out of range" not in whole.text and "ValueError" not in whole.text
    assert streamed.status_code == 200
    events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
    assert events[0] == "{}" and events[-1] == "[DONE]" and len(events) == 3, events
    assert strict_json(events[1]) == {"error": error}
    logged = [r for r in caplog.records if r.exc_info and "Out of range float values" in str(r.exc_info[1])]
    assert [r.getMessage() for r in logged] == ["GET /test/whole failed", "GET /test/stream failed"]
    assert after.status_code == 200  # the server goes on answering
