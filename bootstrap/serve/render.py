"""Executor events to OpenAI bodies: whole responses and server-sent-event chunks.

A stream is: (chat) one chunk with the assistant role; one chunk per piece of new text; one
chunk with ``finish_reason``; with ``stream_options.include_usage`` one chunk with ``usage`` and
no choices; then ``data: [DONE]``. ``finish_reason`` is ``stop``, ``length``, or ``cancelled``
when the server cut the request short (shutdown). An engine error mid-stream is sent as an
``error`` object in OpenAI's shape, then ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from bootstrap.serve import schemas as s
from bootstrap.serve.jobs import Job

DONE = "data: [DONE]\n\n"


def sse(data: BaseModel | dict[str, Any], event: str | None = None) -> str:
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"event: {event}\ndata: {text}\n\n" if event else f"data: {text}\n\n"


class Render:
    """Bodies of one request (``chat`` or ``completion``), sharing its id, time and model."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(self, text: str, finish: str, usage: s.Usage) -> BaseModel:
        if self.kind == "chat":
            choice = s.ChatChoice(message=s.AssistantMessage(content=text), finish_reason=finish)
            return s.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)
        choice = s.CompletionChoice(text=text, finish_reason=finish)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> BaseModel:
        if self.kind == "chat":
            delta = s.Delta(role="assistant" if role else None, content=text)
            choices = [s.ChatChunkChoice(delta=delta, finish_reason=finish)]
            return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        choice = s.CompletionChoice(text=text or "", finish_reason=finish)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: s.Usage) -> BaseModel:
        if self.kind == "chat":
            return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)


async def stream_body(job: Job, render: Render, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of a streaming request; the job is closed (cancelled if unfinished) at the end."""
    try:
        if render.kind == "chat":
            yield sse(render.chunk(text="", role=True))
        async for event in job.events():
            if event.finished and event.finish_reason == "error":
                yield sse({"error": {"message": f"generation failed: {event.error}", "type": "server_error",
                                     "param": None, "code": "engine_error"}})  # fmt: skip
                break
            if event.text:
                yield sse(render.chunk(text=event.text))
            if event.finished:
                yield sse(render.chunk(finish=event.finish_reason))
        if include_usage:
            yield sse(render.usage_chunk(s.Usage.of(job.prompt_tokens, job.tokens)))
        yield DONE
    finally:
        await job.close()


async def collect(job: Job) -> tuple[str, Any]:
    """The whole text and the final event of a non-streaming request."""
    parts, last = [], None
    async for event in job.events():
        parts.append(event.text)
        last = event
    return "".join(parts), last
