"""From an OpenAI request to what the executor takes: prompt token ids and ``SamplingParams``.

Chat messages go through the tokenizer's own chat template; text prompts through the tokenizer
(as ``bootstrap run --chat`` and ``--prompt`` do, so both give the same ids). Every refusal is a
400 naming the field and the numbers or values allowed.
"""

from __future__ import annotations

from typing import Any

from bootstrap.serve.errors import APIError, bad_request
from bootstrap.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Sampling

ROLE_FOR_TEMPLATE = {"developer": "system"}  # templates rarely know OpenAI's newer role name


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        what = "has no tokenizer" if tokenizer is None else "has no chat template"
        raise bad_request(f"messages: this model {what}; use /v1/completions", param="messages")
    chat = [{"role": ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    except Exception as exc:  # the template's own checks (roles must alternate, ...) are the client's to fix
        raise bad_request(f"messages: the chat template refused them: {exc}", param="messages") from exc
    return list(ids)


def completion_prompt_ids(tokenizer: Any, prompt: str | list[Any]) -> list[int]:
    """One prompt: text, or token ids; a list of one text or one id list is that prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            message = f"prompt: {len(prompt)} prompts sent; one prompt per request is supported"
            raise bad_request(message, param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise bad_request("prompt: this model has no tokenizer; send token ids", param="prompt")
    return list(tokenizer(prompt)["input_ids"])


def token_limit(body: _Sampling) -> tuple[int | None, str]:
    """The requested output length and the field that carried it."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def check_length(prompt_len: int, max_tokens: int | None, field: str, max_seq_len: int) -> int:
    """``max_tokens`` (default: what ``max_seq_len`` leaves); 400 naming both numbers if too long."""
    if prompt_len == 0:
        raise bad_request("prompt: empty; at least one prompt token is needed", param="prompt")
    if max_tokens is None:
        if prompt_len >= max_seq_len:
            raise APIError(400, f"prompt ({prompt_len} tokens) leaves no room to generate within max_seq_len "
                           f"({max_seq_len})", param="messages", code="context_length_exceeded")  # fmt: skip
        return max_seq_len - prompt_len
    if prompt_len + max_tokens > max_seq_len:
        raise APIError(400, f"prompt ({prompt_len} tokens) + {field} ({max_tokens}) = {prompt_len + max_tokens} "
                       f"exceeds max_seq_len ({max_seq_len}); shorten the prompt or lower {field}",
                       param=field, code="context_length_exceeded")  # fmt: skip
    return max_tokens


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Any:
    from bootstrap.engine.sampling import SamplingParams  # torch is loaded once the executor is

    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              seed=body.seed, stop=body.stop_list)  # fmt: skip
    except ValueError as exc:  # "SamplingParams.<field> must be ..., got ..."
        field = str(exc).removeprefix("SamplingParams.").split(" ", 1)[0]
        raise bad_request(str(exc).removeprefix("SamplingParams."), param=field) from exc
