"""Executor events to OpenAI bodies: whole responses and server-sent-event chunks.

A stream is: (chat) one chunk with the assistant role; one chunk per piece of new text; one
chunk with ``finish_reason``; with ``stream_options.include_usage`` one chunk with ``usage`` and
no choices; then ``data: [DONE]``. With logprobs asked, every token gets a chunk (its text may be
empty while a character is incomplete) carrying its logprobs (``bootstrap.serve.logprobs``).
``finish_reason`` is ``stop``, ``length``, or ``abort`` (vLLM's value) when the server cut the
request short (shutdown); the engine calls that ``cancelled``. An engine error mid-stream is sent
as an ``error`` object in OpenAI's shape, then ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from bootstrap.serve import schemas as s
from bootstrap.serve.jobs import Job
from bootstrap.serve.logprobs import LogprobsOut

DONE = "data: [DONE]\n\n"


def sse(data: BaseModel | dict[str, Any], event: str | None = None) -> str:
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"event: {event}\ndata: {text}\n\n" if event else f"data: {text}\n\n"


class Render:
    """Bodies of one request (``chat`` or ``completion``), sharing its id, time and model."""

    def __init__(self, kind: str, model: str, logprobs: LogprobsOut | None = None) -> None:
        self.kind, self.model, self.logprobs = kind, model, logprobs
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(self, text: str, finish: str, usage: s.Usage, events: Sequence[Any] = ()) -> BaseModel:
        """The response of a request that delivered ``events`` (all of them, for the logprobs)."""
        logprobs, finish = self._logprobs(events), s.finish_reason(finish)
        if self.kind == "chat":
            choice = s.ChatChoice(message=s.AssistantMessage(content=text), finish_reason=finish, logprobs=logprobs)
            return s.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)
        choice = s.CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              events: Sequence[Any] = ()) -> BaseModel:  # fmt: skip
        """One chunk: text (and the logprobs of the ``events`` that delivered it), or the finish."""
        logprobs = self._logprobs(events) if events else None
        if self.kind == "chat":
            delta = s.Delta(role="assistant" if role else None, content=text)
            choices = [s.ChatChunkChoice(delta=delta, finish_reason=s.finish_reason(finish), logprobs=logprobs)]
            return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        choice = s.CompletionChoice(text=text or "", finish_reason=s.finish_reason(finish), logprobs=logprobs)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, events: Sequence[Any]) -> Any:
        return self.logprobs.of(events) if self.logprobs is not None else None

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
            if event.text or (render.logprobs is not None and event.token_id is not None):
                yield sse(render.chunk(text=event.text, events=[event]))
            if event.finished:
                yield sse(render.chunk(finish=event.finish_reason))
        if include_usage:
            yield sse(render.usage_chunk(s.Usage.of(job.prompt_tokens, job.tokens)))
        yield DONE
    finally:
        await job.close()


async def collect(job: Job) -> list[Any]:
    """Every event of a non-streaming request, the final one last."""
    return [event async for event in job.events()]
