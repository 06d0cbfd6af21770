"""The OpenAI request and response bodies this server takes and gives (pydantic).

Requests forbid fields they do not know, so a parameter this server does not implement is a
400 naming it rather than silently ignored. Ranges follow OpenAI's API reference.

Every list is bounded (``MAX_ITEMS``) and stops at its first bad item: pydantic checks a list of
numbers or texts in one call that the event loop waits out, and reports every bad item
(issue 20: a body of millions of items held ``/health`` seconds). A bound is checked on the
list's length, before any item.
"""

from __future__ import annotations

from itertools import islice
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from bootstrap.engine.request.prompts import MAX_CHOICES, unencodable

MAX_SEED = 2**63 - 1
MAX_STOPS = 4
MAX_STOP_IDS = 256
MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI: chat 20, completions 5)
MAX_PROMPTS = 64  # completions' prompt list: each prompt is its own choice, enqueued at once
MAX_ITEMS = 2**17  # items of any list in a request: as many token ids as a 128k context holds
MAX_CACHE_SALT_CHARS = 1024  # the engine's bound (``PyExecutor``'s ``check_cache_salt``; its module imports torch)


def _items(item: object, limit: int = MAX_ITEMS) -> object:
    """The type of a list of ``item`` of at most ``limit`` items, checked up to its first bad one."""
    return Annotated[list[item], Field(max_length=limit, fail_fast=True)]


TokenIds = _items(int)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _not_too_many_fields(cls, data: object) -> object:
        """An object with more fields than the model has is refused in one line, not one per
        unknown field (a body can carry a million)."""
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            unknown = list(islice((k for k in data if k not in cls.model_fields), 3))
            raise ValueError(f"{len(data)} fields sent, {len(cls.model_fields)} exist; unknown: {unknown}")
        return data

    @field_validator("*")
    @classmethod
    def _encodable(cls, value: object) -> object:
        return encodable(value)


def encodable(value: object) -> object:
    """Text a tokenizer can take: a lone surrogate (valid in JSON as ``\\ud800``) is not UTF-8,
    so every string of every request field, in lists too, is refused naming its field."""
    for text in _strings(value):
        problem = unencodable(text)
        if problem is not None:
            raise ValueError(problem)
    return value


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [text for item in value for text in _strings(item)]
    return []


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate; default: what max_seq_len leaves")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(
        1, ge=1, le=MAX_CHOICES, description="choices per prompt: one prefill, the prompt's KV blocks shared"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | _items(str) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: minus this for a token generated before"
    )
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's: minus this times the token's count")
    # the usual extensions (vLLM, SGLang, trtllm-serve)
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="a seen token's logit divided by it (positive) or times it (negative)",
    )
    top_k: int = Field(0, ge=-1, description="the k most likely tokens only; 0 or -1: off")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="tokens below min_p times the top token's probability dropped"
    )
    stop_token_ids: _items(Annotated[int, Field(ge=0)], MAX_STOP_IDS) | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="tokens before EOS, a stop token or a stop string may end it")
    cache_salt: str | None = Field(
        None, description="vLLM's: the prefix cache shares a prompt's blocks only with requests of the same salt"
    )

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt(cls, value: object) -> object:
        """The engine's rule (``check_cache_salt``) in the server's words; checked before pydantic's own."""
        if value is None or (isinstance(value, str) and 1 <= len(value) <= MAX_CACHE_SALT_CHARS):
            return value
        sent = f"; {len(value)} sent" if isinstance(value, str) else ""
        raise ValueError(f"must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, or left out{sent}")

    @field_validator("stop", mode="before")
    @classmethod
    def _few_stops(cls, value: object) -> object:
        if isinstance(value, list) and len(value) > MAX_STOPS:  # before checking millions of them
            raise ValueError(f"at most {MAX_STOPS} non-empty stop strings")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):  # more than MAX_STOPS: refused before (_few_stops)
            raise ValueError(f"at most {MAX_STOPS} non-empty stop strings")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | _items(str) | _items(TokenIds) = Field(description="text, token ids, or a list of either")
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate (OpenAI's default: 16)")
    echo: Literal[False] = False
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="each token's logprob and this many alternatives"
    )
    best_of: Literal[1] | None = None
    suffix: None = None

    @property
    def engine_logprobs(self) -> int | None:
        """What the engine's ``SamplingParams.logprobs`` takes: alternatives per token, or None."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: object) -> object:
        """A list of texts or of id lists holds at most ``MAX_PROMPTS``: more are refused before checking them."""
        if isinstance(value, list) and len(value) > MAX_PROMPTS and isinstance(value[0], str | list):
            raise ValueError(f"{len(value)} prompts sent; at most {MAX_PROMPTS} per request")
        return value

    @field_validator("prompt")
    @classmethod
    def _no_empty_list(cls, value: object) -> object:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list: send a text, token ids, or a list of them")
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | _items(TextPart) | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1, description="same as max_tokens, which it overrides")
    logprobs: bool | None = Field(None, description="each token's logprob in choices[].logprobs.content")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token; needs logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):  # OpenAI's rule, and vLLM's
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def engine_logprobs(self) -> int | None:
        """What the engine's ``SamplingParams.logprobs`` takes: alternatives per token, or None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ------------------------------------------------------------------------------


FINISH_REASONS = {"cancelled": "abort"}  # the engine's name -> the one clients know (vLLM's); stop, length pass


def finish_reason(engine_reason: str | None) -> str | None:
    """``finish_reason`` as responses and metrics give it: ``stop``, ``length`` or ``abort``."""
    return FINISH_REASONS.get(engine_reason, engine_reason) if engine_reason else engine_reason


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0) -> Usage:
        details = PromptTokensDetails(cached_tokens=cached)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )


class Choice(BaseModel):
    """What every choice carries: its index (``n`` is 1)."""

    index: int = 0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class Envelope(BaseModel):
    """What every response object carries besides its ``object`` name and choices."""

    id: str
    created: int
    model: str


class CompletionChoice(Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Choice):
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "executor-bootstrap"
    max_model_len: int | None = None
    state: str = "ready"  # the server's phase: asleep or in an operation, the model is still listed


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
