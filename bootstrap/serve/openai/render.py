"""Executor events to OpenAI bodies: whole responses and server-sent-event chunks.

A stream is: (chat) one chunk with the assistant role; one chunk per piece of new text; one
chunk with ``finish_reason``; with ``stream_options.include_usage`` one chunk with ``usage`` and
no choices; then ``data: [DONE]``. With logprobs asked, every token gets a chunk (its text may be
empty while a character is incomplete) carrying its logprobs (``bootstrap.serve.openai.logprobs``).
``finish_reason`` is ``stop``, ``length``, or ``abort`` (vLLM's value) when the server cut the
request short (shutdown); the engine calls that ``cancelled``. An engine error mid-stream is sent
as an ``error`` object in OpenAI's shape, then ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic_core import to_json

from bootstrap.serve.openai import schemas as s
from bootstrap.serve.openai.logprobs import LogprobsOut, TokenDecoder

if TYPE_CHECKING:
    from bootstrap.engine.request.stream_event import StreamEvent

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: BaseModel | dict[str, Any], event: str | None = None) -> str:
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"event: {event}\ndata: {text}\n\n" if event else f"data: {text}\n\n"


class Render:
    """Bodies of one request (``chat`` or ``completion``), sharing its id, time and model; choice
    ``index`` i is the i-th job of ``bootstrap.serve.openai.choices.Choices``. With ``logprobs``
    asked, each choice's logprobs are built from its events (``LogprobsOut``, naming tokens
    with ``tokenizer``)."""

    def __init__(self, kind: str, model: str, logprobs: bool = False, tokenizer: TokenDecoder | None = None) -> None:
        self.kind, self.model, self.with_logprobs, self.tokenizer = kind, model, logprobs, tokenizer
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._logprobs: dict[int, LogprobsOut] = {}
        constants = to_json({"id": self.id, "created": self.created, "model": model}).decode()[:-1]
        kind_name = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = f'data: {constants},"object":"{kind_name}","choices":[{{"index":'

    def token_chunk(self, index: int, event: StreamEvent) -> str:
        """The SSE chunk of one token's text (with its logprobs, if asked): a stream's hot path,
        the request's constant fields written once (``_head``); the same bytes as ``sse(chunk(...))``."""
        logprobs = self.logprobs(index, [event])
        shown = "null" if logprobs is None else logprobs.model_dump_json()
        text = to_json(event.text).decode()
        if self.kind == "chat":
            body = f'"delta":{{"role":null,"content":{text}}},"logprobs":{shown}'
        else:
            body = f'"text":{text},"logprobs":{shown}'
        return f'{self._head}{index},{body},"finish_reason":null}}],"usage":null}}\n\n'

    def whole(self, outcomes: Sequence[tuple[str, str, Sequence[StreamEvent]]], usage: s.Usage) -> BaseModel:
        """The response: per choice, in index order, its text, finish reason and every event."""
        if self.kind == "chat":
            chats = [
                s.ChatChoice(
                    index=i,
                    message=s.AssistantMessage(content=text),
                    finish_reason=s.finish_reason(end),
                    logprobs=self.logprobs(i, events),
                )
                for i, (text, end, events) in enumerate(outcomes)
            ]
            return s.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=chats, usage=usage)
        texts = [
            s.CompletionChoice(
                index=i, text=text, finish_reason=s.finish_reason(end), logprobs=self.logprobs(i, events)
            )
            for i, (text, end, events) in enumerate(outcomes)
        ]
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=texts, usage=usage)

    def chunk(
        self,
        index: int,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        events: Sequence[StreamEvent] = (),
    ) -> BaseModel:
        """One chunk of choice ``index``: text (and the logprobs of the ``events`` that delivered
        it), or its finish."""
        logprobs = self.logprobs(index, events) if events else None
        if self.kind == "chat":
            delta = s.Delta(role="assistant" if role else None, content=text)
            choices = [
                s.ChatChunkChoice(index=index, delta=delta, finish_reason=s.finish_reason(finish), logprobs=logprobs)
            ]
            return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        choice = s.CompletionChoice(
            index=index, text=text or "", finish_reason=s.finish_reason(finish), logprobs=logprobs
        )
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def logprobs(self, index: int, events: Sequence[StreamEvent]) -> s.ChatLogprobs | s.CompletionLogprobs | None:
        """Choice ``index``'s logprobs for ``events`` (each passed once, in order), or None when not asked."""
        if not self.with_logprobs:
            return None
        out = self._logprobs.get(index)
        if out is None:
            out = self._logprobs[index] = LogprobsOut(self.kind, self.tokenizer)
        return out.of(events)

    def usage_chunk(self, usage: s.Usage) -> BaseModel:
        if self.kind == "chat":
            return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)


async def stream_body(
    batches: AsyncIterator[tuple[int, list[StreamEvent]]],
    choices: int,
    render: Render,
    usage: Callable[[], s.Usage | None],
) -> AsyncIterator[str]:
    """The SSE body of a streaming request from its choices' ``(index, events)`` batches, merged
    in the order they came (``bootstrap.serve.openai.choices``): a batch's chunks (one per token)
    leave in one write. ``usage()`` is the usage chunk's, if asked."""
    if render.kind == "chat":
        for index in range(choices):
            yield sse(render.chunk(index, text="", role=True))
    async for index, events in batches:
        chunks = [chunk for event in events for chunk in _chunks(render, index, event)]
        if chunks:
            yield "".join(chunks)
        if events and events[-1].finish_reason == "error":  # its chunk was the last: the stream ends
            break
    totals = usage()
    if totals is not None:
        yield sse(render.usage_chunk(totals))
    yield DONE


def _chunks(render: Render, index: int, event: StreamEvent) -> list[str]:
    """The SSE chunks of one event: its text (or, with logprobs, its token), its finish, or an
    engine error's chunk (the stream's last but ``[DONE]``)."""
    if event.finished and event.finish_reason == "error":
        error = {"message": f"generation failed: {event.error}", "type": "server_error", "param": None}
        return [sse({"error": {**error, "code": "engine_error"}})]
    out = []
    if event.text or (render.with_logprobs and event.token_id is not None):
        out.append(render.token_chunk(index, event))
    if event.finished:
        out.append(sse(render.chunk(index, finish=event.finish_reason)))
    return out
