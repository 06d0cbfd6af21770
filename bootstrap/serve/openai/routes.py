"""OpenAI-compatible ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

Before the executor is ready every one of them answers 503 with ``Retry-After``. A client that
disconnects, or a handler that is cancelled, cancels its request in the executor (``Job``).
Bodies are parsed and checked (``bodies``) and prompts tokenized (``inputs``) on a worker
thread: the event loop only awaits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from bootstrap.serve.errors import APIError
from bootstrap.serve.openai import schemas as s
from bootstrap.serve.openai.bodies import body_of, parsed
from bootstrap.serve.openai.choices import Choices, ChoicesStream
from bootstrap.serve.openai.inputs import (
    chat_prompt_ids,
    check_lengths,
    completion_prompt_ids,
    sampling_params,
    token_limit,
)
from bootstrap.serve.openai.jobs import unless_disconnected
from bootstrap.serve.openai.readiness import ready_executor
from bootstrap.serve.openai.render import Render
from bootstrap.serve.request_trace import SCOPE_KEY
from bootstrap.serve.state import ServeState

if TYPE_CHECKING:
    from bootstrap.engine.executor.channel.client import EngineClient  # zmq: with the first executor

CLIENT_CLOSED = 499  # the client went away; nobody reads this status
AGAIN = {"Retry-After": "1"}
LISTED = ("ready", "swapping", "updating_weights", "sleeping", "asleep", "waking")  # a model is configured

router = APIRouter(prefix="/v1")


def check_model(state: ServeState, model: str) -> None:
    if model != state.model_id:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_id!r}",
            param="model",
            code="model_not_found",
        )


@router.get("/models")
async def list_models(request: Request) -> s.ModelList:
    """The served model with the server's phase (``state``) whenever one is configured, asleep or
    mid-operation too (vLLM lists it then, and routers drop a server that stops listing it);
    503 only before the first start settles and with no model (``--idle``)."""
    state: ServeState = request.app.state.serve
    if state.phase not in LISTED:
        ready_executor(state)
    created = int(request.app.state.created)
    model = s.Model(id=state.model_id, created=created, max_model_len=state.max_seq_len, state=state.phase)
    return s.ModelList(data=[model])


@router.post("/completions", response_model=None, openapi_extra=body_of(s.CompletionRequest))
async def completions(request: Request) -> Response:
    body = await parsed(request, s.CompletionRequest)
    executor, max_seq_len = serving_executor(request, body.model), request.app.state.serve.max_seq_len
    prompts = await completion_prompt_ids(executor.tokenizer, body.prompt, max_seq_len)
    return await answer(
        request, body, prompts, Render("completion", body.model, body.engine_logprobs is not None, executor.tokenizer)
    )


@router.post("/chat/completions", response_model=None, openapi_extra=body_of(s.ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    body = await parsed(request, s.ChatCompletionRequest)
    executor, max_seq_len = serving_executor(request, body.model), request.app.state.serve.max_seq_len
    ids = await chat_prompt_ids(executor.tokenizer, body.messages, max_seq_len)
    return await answer(
        request, body, [ids], Render("chat", body.model, body.engine_logprobs is not None, executor.tokenizer)
    )


def serving_executor(request: Request, model: str) -> EngineClient:
    """The ready executor, for a request that names this server's model (else 503 or 404)."""
    state: ServeState = request.app.state.serve
    executor = ready_executor(state)
    check_model(state, model)
    return executor


async def answer(
    request: Request, body: s.CompletionRequest | s.ChatCompletionRequest, prompts: list[list[int]], render: Render
) -> Response:
    """Enqueue a job per prompt; wait for their first events (a refusal is still a 400); stream
    or collect the rest."""
    state: ServeState = request.app.state.serve
    limit, field = token_limit(body)
    params = [sampling_params(body, tokens) for tokens in check_lengths(prompts, limit, field, state.max_seq_len)]
    if ready_executor(state).tokenizer is not render.tokenizer:  # a swap ended while the prompt was read
        raise APIError(
            503, "the model changed while this request was read; send it again", headers={"Retry-After": "1"}
        )
    span = getattr(request.state, SCOPE_KEY, None)  # set by RequestTracing when this request is traced
    metrics = request.app.state.metrics
    choices = await Choices.start(state, metrics, render.kind, prompts, params, body.n, span, body.cache_salt)
    try:
        if await unless_disconnected(request, choices.first_events) is None:
            await choices.close()  # gone before its first token: every choice is cancelled, not left running
            return Response(status_code=CLIENT_CLOSED)
        if body.stream:
            return ChoicesStream(choices, render, body.include_usage)
        return await whole(request, choices, render)
    except BaseException:
        await choices.close()
        raise


async def whole(request: Request, choices: Choices, render: Render) -> Response:
    events = await unless_disconnected(request, choices.collect)
    await choices.close()
    if events is None:
        return Response(status_code=CLIENT_CLOSED)
    failed = next((e[-1] for e in events if e[-1].finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"generation failed: {failed.error}", code="engine_error")
    outcomes = [("".join(e.text for e in each), each[-1].finish_reason, each) for each in events]
    return JSONResponse(render.whole(outcomes, choices.usage()).model_dump())
