"""From an OpenAI request to what the executor takes, through the engine's prompt rules
(``bootstrap.engine.prompts``, which ``bootstrap run`` uses too, so both give the same ids and
refuse the same requests). Here: OpenAI's shapes (roles, prompt lists, which field carries the
output length) and every ``PromptError`` as a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from bootstrap.engine import prompts
from bootstrap.serve.errors import APIError, bad_request
from bootstrap.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Sampling

ROLE_FOR_TEMPLATE = {"developer": "system"}  # templates rarely know OpenAI's newer role name
T = TypeVar("T")


def _answered(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(...)``, its ``PromptError`` as a 400 naming the field."""
    try:
        return fn(*args, **kwargs)
    except prompts.PromptError as exc:
        raise APIError(400, str(exc), param=exc.field, code=exc.code) from exc


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    chat = [{"role": ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()} for m in messages]
    return _answered(prompts.chat_ids, tokenizer, chat)


def completion_prompt_ids(tokenizer: Any, prompt: str | list[Any]) -> list[int]:
    """One prompt: text, or token ids; a list of one text or one id list is that prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            message = f"prompt: {len(prompt)} prompts sent; one prompt per request is supported"
            raise bad_request(message, param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return list(prompt)
    return _answered(prompts.text_ids, tokenizer, prompt)


def token_limit(body: _Sampling) -> tuple[int | None, str]:
    """The requested output length and the field that carried it."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def check_length(prompt_len: int, max_tokens: int | None, field: str, max_seq_len: int) -> int:
    """``max_tokens`` (default: what ``max_seq_len`` leaves); 400 naming both numbers if too long."""
    return _answered(prompts.checked_max_tokens, prompt_len, max_tokens, max_seq_len, field)


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Any:
    return _answered(prompts.sampling_params, max_tokens, temperature=body.temperature, top_p=body.top_p,
                     seed=body.seed, stop=body.stop_list)  # fmt: skip
