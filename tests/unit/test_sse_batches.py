"""A streaming request's events leave as they came in: a batch of them (a reader that fell
behind, ``EngineClient.next_events``) is one write of one SSE chunk per token, in order, its
finish after them; an engine error's chunk ends the stream, ``[DONE]`` after it."""

from __future__ import annotations

import json

import anyio

from bootstrap.engine.request.stream_event import StreamEvent
from bootstrap.serve.openai.render import DONE, Render, stream_body


async def batches(*items):
    for item in items:
        yield item


def written(*items, kind: str = "completion", logprobs: bool = False) -> list[str]:
    render = Render(kind, "m", logprobs)

    async def body() -> list[str]:
        return [part async for part in stream_body(batches(*items), 1, render, lambda: None)]

    return anyio.run(body)


def data(write: str) -> list[dict]:
    return [json.loads(line[6:]) for line in write.split("\n\n") if line.startswith("data: {")]


def test_a_batch_is_one_write_of_a_chunk_per_token_then_its_finish():
    events = [StreamEvent(5, "a"), StreamEvent(6, "b"), StreamEvent(7, "c", "length")]
    writes = written((0, events[:1]), (0, events[1:]))
    assert len(writes) == 3 and writes[-1] == DONE
    assert [c["choices"][0]["text"] for c in data(writes[0])] == ["a"]
    second = data(writes[1])
    assert [c["choices"][0]["text"] for c in second] == ["b", "c", ""]
    assert [c["choices"][0]["finish_reason"] for c in second] == [None, None, "length"]


def test_with_logprobs_a_token_without_text_still_has_its_chunk():
    events = [
        StreamEvent(5, "", logprob=-0.1, text_offset=0),
        StreamEvent(6, "ab", "stop", logprob=-0.2, text_offset=0),
    ]
    [write, done] = written((0, events), logprobs=True)
    chunks = data(write)
    assert done == DONE and [c["choices"][0]["text"] for c in chunks] == ["", "ab", ""]
    assert [c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks[:2]] == [[-0.1], [-0.2]]


def test_an_engine_error_ends_the_stream_after_what_came_before_it():
    events = [StreamEvent(5, "a"), StreamEvent(None, "", "error", "the engine's process exited")]
    writes = written((0, events), (0, [StreamEvent(9, "never")]))
    assert writes[-1] == DONE and len(writes) == 2
    first, error = data(writes[0])
    assert first["choices"][0]["text"] == "a"
    assert error["error"]["code"] == "engine_error" and "the engine's process exited" in error["error"]["message"]
