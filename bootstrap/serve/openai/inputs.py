"""From an OpenAI request to what the executor takes, through the engine's prompt rules
(``bootstrap.engine.request.prompts``, which ``bootstrap run`` uses too, so both give the same ids and
refuse the same requests). Here: OpenAI's shapes (roles, prompt lists, which field carries the
output length) and every ``PromptError`` as a 400 naming the field.

Tokenizing and rendering a chat template cost CPU in proportion to the prompt, so they run on a
worker thread, never on the event loop (issue 20: one 9 MB prompt stalled ``/health`` for
seconds); and a text too long for ``max_seq_len`` under any tokenizer is refused before either
(``check_chars``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import anyio

from bootstrap.engine.request import prompts
from bootstrap.serve.errors import APIError
from bootstrap.serve.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Sampling

if TYPE_CHECKING:
    from bootstrap.engine.sampling.params import SamplingParams

ROLE_FOR_TEMPLATE = {"developer": "system"}  # templates rarely know OpenAI's newer role name
# The most characters one token can stand for, in any tokenizer served. The longest entries of
# common vocabularies (runs of spaces or of punctuation in code tokenizers) stay under 128
# characters; byte-level BPE tokens are at most their bytes. 256 doubles that margin, so a text
# refused by it could never have fit, whatever the tokenizer.
MAX_CHARS_PER_TOKEN = 256
T = TypeVar("T")
P = ParamSpec("P")


def _answered(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(...)``, its ``PromptError`` as a 400 naming the field."""
    try:
        return fn(*args, **kwargs)
    except prompts.PromptError as exc:
        raise APIError(400, str(exc), param=exc.field, code=exc.code) from exc


def check_chars(chars: int, max_seq_len: int | None, field: str) -> None:
    """Refuse, without tokenizing, a text of ``chars`` characters that cannot fit ``max_seq_len``
    tokens under any tokenizer; the same 400 as a prompt counted too long."""
    if max_seq_len is None:
        return
    limit = max_seq_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(
            400,
            f"{field}: {chars} characters cannot fit max_seq_len ({max_seq_len}) tokens (a token "
            f"covers at most {MAX_CHARS_PER_TOKEN} characters); allowed: at most {limit} characters",
            param=field,
            code="context_length_exceeded",
        )


async def chat_prompt_ids(tokenizer: object | None, messages: list[ChatMessage], max_seq_len: int | None) -> list[int]:
    """The messages through the chat template, on a worker thread once the length allows it;
    ``tokenizer`` is the executor's, taken as it is by the engine's prompt rules."""
    chat = [{"role": ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()} for m in messages]
    check_chars(sum(len(m["content"]) for m in chat), max_seq_len, "messages")
    return await anyio.to_thread.run_sync(_answered, prompts.chat_ids, tokenizer, chat)


async def completion_prompt_ids(
    tokenizer: object | None, prompt: str | list[int] | list[str] | list[list[int]], max_seq_len: int | None
) -> list[list[int]]:
    """The prompts, in order: text, token ids, or a list of either (``schemas.MAX_PROMPTS`` at
    most). Every text's length is checked first; then all are tokenized on one worker thread."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items = prompt if many else [prompt]
    for i, item in enumerate(items):
        if isinstance(item, str):
            check_chars(len(item), max_seq_len, f"prompt[{i}]" if many else "prompt")
    return await anyio.to_thread.run_sync(_ids_of, tokenizer, items)


def _ids_of(tokenizer: object | None, items: Sequence[str | list[int]]) -> list[list[int]]:
    return [list(item) if isinstance(item, list) else _answered(prompts.text_ids, tokenizer, item) for item in items]


def token_limit(body: _Sampling) -> tuple[int | None, str]:
    """The requested output length and the field that carried it."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def check_length(prompt_len: int, max_tokens: int | None, field: str, max_seq_len: int) -> int:
    """``max_tokens`` (default: what ``max_seq_len`` leaves); 400 naming both numbers if too long."""
    return _answered(prompts.checked_max_tokens, prompt_len, max_tokens, max_seq_len, field)


def check_lengths(prompt_ids: list[list[int]], max_tokens: int | None, field: str, max_seq_len: int) -> list[int]:
    """``check_length`` of each prompt; with several, a refusal names the prompt (``prompt[i]: ...``)."""
    limits = []
    for i, ids in enumerate(prompt_ids):
        try:
            limits.append(check_length(len(ids), max_tokens, field, max_seq_len))
        except APIError as exc:
            if len(prompt_ids) == 1:
                raise
            raise APIError(exc.status, f"prompt[{i}]: {exc.message}", param=exc.param, code=exc.code) from exc
    return limits


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``body``; a refusal (``min_tokens`` over ``max_tokens``) is a 400."""
    return _answered(
        prompts.sampling_params,
        max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=body.engine_logprobs,
    )
