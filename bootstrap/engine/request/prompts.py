"""From what a user gives to what ``PyExecutor.enqueue`` takes: prompt token ids, an output
length that fits ``max_seq_len``, and ``SamplingParams``.

One set of rules for every way in: ``bootstrap run`` (``--prompt``, ``--chat``), the server's
completions and chat routes, and the executor's own admission check (``length_problem``), so
all three refuse the same requests with the same words. Every refusal is a ``PromptError``
naming the field at fault (the CLI exits 2 with it; the server answers 400 with it as
``param``). No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bootstrap.config import ConfigError
from bootstrap.engine.sampling.params import SamplingParams

MAX_CHOICES = 16  # choices of one prompt (n), prefilled once: PyExecutor.enqueue_choices
EMPTY_PROMPT = "prompt: empty; at least one prompt token is needed"


class PromptError(ConfigError):
    """A prompt or sampling value the executor cannot take; ``field`` names it, ``code`` is the
    OpenAI error code the server reports (``context_length_exceeded`` for a prompt too long)."""

    def __init__(self, message: str, field: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.field, self.code = field, code


def unencodable(text: str) -> str | None:
    """Why ``text`` is no text a tokenizer can take, or None: a lone surrogate (a JSON
    ``\\ud800`` escape, or an argv byte that is not UTF-8, which Python decodes with
    ``surrogateescape``: ``--prompt $'w4 \\xff'``) has no UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"must be text UTF-8 can encode (a lone surrogate at character {exc.start})"
    return None


def check_text(field: str, text: str | None) -> None:
    """``PromptError`` naming ``field`` when ``text`` is given and UTF-8 cannot encode it."""
    problem = None if text is None else unencodable(text)
    if problem is not None:
        raise PromptError(f"{field}: {problem}", field=field)


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]], field: str = "messages") -> list[int]:
    """``messages`` (``role``, ``content``) through the tokenizer's chat template, with the
    generation prompt appended."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        what = "has no tokenizer" if tokenizer is None else "has no chat template"
        raise PromptError(f"{field}: this model {what}; send a plain text prompt", field=field)
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=False)
    except Exception as exc:  # the template's own checks (roles must alternate, ...) are the caller's to fix
        raise PromptError(f"{field}: the chat template refused them: {exc}", field=field) from exc
    return list(ids)


def text_ids(tokenizer: Any, text: str, field: str = "prompt") -> list[int]:
    if tokenizer is None:
        raise PromptError(f"{field}: this model has no tokenizer (random weights); send token ids", field=field)
    return list(tokenizer(text)["input_ids"])


def token_id_problem(ids: Sequence[object], vocab_size: int) -> str | None:
    """What is wrong with prompt token ``ids`` for a vocabulary of ``vocab_size``, or None."""
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    return f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]}" if bad else None


def length_problem(prompt_len: int, max_tokens: int, max_seq_len: int, field: str = "max_tokens") -> str | None:
    """Why a prompt of ``prompt_len`` tokens plus ``max_tokens`` to generate cannot run within
    ``max_seq_len``, or None when it can."""
    if prompt_len == 0:
        return EMPTY_PROMPT
    if prompt_len + max_tokens > max_seq_len:
        return (
            f"prompt ({prompt_len} tokens) + {field} ({max_tokens}) = {prompt_len + max_tokens} exceeds "
            f"max_seq_len ({max_seq_len}); shorten the prompt or lower {field}"
        )
    return None


def checked_max_tokens(prompt_len: int, max_tokens: int | None, max_seq_len: int, field: str = "max_tokens") -> int:
    """``max_tokens``, or by default all that ``max_seq_len`` leaves after the prompt; a
    ``PromptError`` naming both numbers when they do not fit."""
    if max_tokens is None:
        if 0 < prompt_len >= max_seq_len:
            raise PromptError(
                f"prompt ({prompt_len} tokens) leaves no room to generate within max_seq_len ({max_seq_len})",
                field="messages",
                code="context_length_exceeded",
            )
        max_tokens = max_seq_len - prompt_len
    problem = length_problem(prompt_len, max_tokens, max_seq_len, field)
    if problem is not None:
        code = "invalid_request" if prompt_len == 0 else "context_length_exceeded"
        raise PromptError(problem, field="prompt" if prompt_len == 0 else field, code=code)
    return max_tokens


def sampling_params(max_tokens: int, **options: Any) -> SamplingParams:
    """``SamplingParams(max_tokens=..., **options)``; its refusal as a ``PromptError`` naming the
    field (``SamplingParams.<field> must be ..., got ...``)."""
    try:
        return SamplingParams(max_tokens=max_tokens, **options)
    except ValueError as exc:
        text = str(exc).removeprefix("SamplingParams.")
        raise PromptError(text, field=text.split(" ", 1)[0]) from exc
