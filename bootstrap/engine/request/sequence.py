"""Per-request state as the engine sees it: tokens, progress, status and outcome.

``token_ids`` holds the prompt followed by the generated tokens. ``num_computed`` counts the
leading tokens whose keys and values are in the KV cache; the tokens after them are what the
next step must run (a prefill chunk, or the one token sampled last step). A step that brings
``num_computed`` up to ``len(token_ids)`` yields logits for a new token; a partial prefill chunk
does not. With overlap scheduling a step's tokens reach the host one step late: ``in_flight``
counts the tokens sampled on the device and not yet appended, which the next step already runs.
"""

from __future__ import annotations

import enum
import itertools
import operator
from dataclasses import dataclass, field

import torch

from bootstrap.engine.request.acceptance import Acceptance
from bootstrap.engine.request.stream_event import StreamEvent as StreamEvent  # re-exported: callers import it here
from bootstrap.engine.request.timing import RequestClock, RequestTiming
from bootstrap.engine.sampling.processing import TokenLogprob
from bootstrap.engine.sampling.sampler import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def next_request_id() -> int:
    """A process-wide unique request id."""
    return next(_ids)


@dataclass(eq=False)
class Sequence:
    """One request inside the engine (``eq=False``: compared and hashed by identity)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    is_warmup: bool = False
    generator: torch.Generator | None = None
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    stop_from: int = 0  # text offset where stop strings start to count: the ``min_tokens``-th token's text
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked
    forks: list[Sequence] = field(default_factory=list)  # the other choices of its prompt, until its prefill ends
    clock: RequestClock = field(default_factory=RequestClock)  # its passage, written by the engine thread
    draft_computed: int = 0  # leading tokens whose KV is in the draft's pool (speculative decoding)
    acceptance: Acceptance = field(default_factory=Acceptance)  # its draft's recent acceptance (auto)
    cache_salt: str | None = None  # prefix caching: only requests of the same salt share blocks
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache
    block_digests: list[bytes] = field(default_factory=list)  # of its full blocks so far (``prefix_hash``)
    published: int = 0  # leading blocks registered in the prefix cache
    draft_published: int = 0  # and in the draft's pool
    in_flight: int = 0  # tokens sampled on the device, not yet appended (overlap scheduling)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending(self) -> int:
        """Tokens the next steps must run before a new token can be sampled (an in-flight one included)."""
        return self.num_tokens + self.in_flight - self.num_computed

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, those still in flight included."""
        return self.num_tokens + self.in_flight - self.num_prompt_tokens

    @property
    def ends_in_flight(self) -> bool:
        """True when the tokens in flight reach ``max_tokens``: a next step would be wasted."""
        return self.in_flight > 0 and self.num_generated >= self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    @property
    def max_kv_tokens(self) -> int:
        """KV slots the request can ever use: every token but the last generated one."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error


@dataclass(frozen=True)
class Response:
    """The outcome of one request. ``finish_reason``: stop, length, error or cancelled."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    is_warmup: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per generated token when params.logprobs is set
    timing: RequestTiming | None = None  # when it was queued, admitted, first sampled and finished
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")


class Detokenizer:
    """Incremental detokenization: the text each new token adds, stable across token merges.

    Decodes a short window (``ids[prefix:]`` against ``ids[prefix:read]``) instead of the whole
    output, and holds text back while it ends in an incomplete UTF-8 character.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: the text still held back (an incomplete character)."""
        delta = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def token_id_list(prompt_token_ids: object) -> list[int]:
    """``prompt_token_ids`` as a list of Python ints (numpy and torch integers accepted)."""
    if isinstance(prompt_token_ids, str | bytes | dict) or not hasattr(prompt_token_ids, "__iter__"):
        raise TypeError(
            f"prompt_token_ids must be a sequence of token ids, got {type(prompt_token_ids).__name__}; "
            "tokenize first (e.g. apply_chat_template(..., return_dict=False))"
        )
    try:
        return [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        kinds = sorted({type(t).__name__ for t in prompt_token_ids})
        raise TypeError(f"prompt_token_ids must hold integers, got {', '.join(kinds)}") from None
