"""``SamplingParams``: how one request picks its tokens and when it stops, checked as it is made.

Apart from the sampler (``bootstrap.engine.sampling.sampler``, which imports torch), so the
server's side of the channel (``bootstrap.engine.executor.channel``) builds and sends them without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from bootstrap.config import is_int

MAX_SEED = 2**63 - 1
MAX_INT = 2**63 - 1  # an integer field's bound: what a 64-bit frame of the engine channel carries
MAX_LOGPROBS = 20


def _fail(name: str, allowed: str, value: object) -> NoReturn:
    raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _as_tuple(name: str, value: object) -> tuple:
    """``value`` as a tuple; a lone string is one item, a non-iterable a clear error."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        _fail(name, "a list or tuple", value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request, and when to stop it.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` switch those filters off.
    ``stop_token_ids`` and ``stop`` (strings) end the request with reason ``"stop"``, as does
    an EOS token unless ``ignore_eos``. Lists given for the tuple fields are stored as tuples;
    a plain string for ``stop`` is one stop string (as in the OpenAI API), not its characters.

    ``min_p == 0``, ``presence_penalty == frequency_penalty == 0`` and ``repetition_penalty == 1``
    are off. ``min_tokens``: no stop (token, EOS or string) before that many tokens. ``logprobs``:
    None, or how many top alternatives to return with each generated token's logprob.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop))
        self._check_numbers()
        self._check_stops()
        self._check_surface()

    def _check_numbers(self) -> None:
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT:
            _fail("max_tokens", f"an integer in [1, {MAX_INT}]", self.max_tokens)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            _fail("temperature", "a finite number >= 0 (0 = greedy)", t)
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT:
            _fail("top_k", f"an integer in [0, {MAX_INT}] (0 = off)", self.top_k)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            _fail("top_p", "a number in (0, 1] (1 = off)", p)
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            _fail("seed", f"None or an integer in [0, {MAX_SEED}]", self.seed)

    def _check_stops(self) -> None:
        if not all(is_int(t) and 0 <= t <= MAX_INT for t in self.stop_token_ids):
            _fail("stop_token_ids", f"a tuple of integers in [0, {MAX_INT}]", self.stop_token_ids)
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "a tuple of non-empty strings", self.stop)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "a bool", self.ignore_eos)

    def _check_surface(self) -> None:
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", "a number in [0, 1] (0 = off)", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, "a number in [-2, 2] (0 = off)", value)
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            _fail("repetition_penalty", "a finite number > 0 (1 = off)", r)
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature == 0
