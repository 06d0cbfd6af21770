"""Sampling: per-request parameters, a batched device sampler, and stop checks.

The sampler handles a whole batch in a few tensor operations: greedy rows take the argmax,
sampled rows are scaled by their temperature, cut by their own top-k and top-p (which never
remove a row's most likely token, so no row is ever left without a candidate), and drawn
with the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``), which is an exact
categorical draw. Each seeded request fills its own row of noise from its own
``torch.Generator``, so a seeded request gives the same tokens whatever else is in the batch.

Before that, rows that use a penalty or have not reached their ``min_tokens`` get their logits
changed (``bootstrap.engine.sampling.processing``; greedy rows too, so a penalty can change the
argmax), and ``min_p`` drops, after temperature, what is less likely than ``min_p`` times the
row's most likely token. A batch with none of these pays nothing for them.
``sample_with_logprobs`` adds, for the rows that ask, the logprobs of the raw model logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bootstrap.engine.sampling.argmax import argmax
from bootstrap.engine.sampling.params import MAX_LOGPROBS as MAX_LOGPROBS  # re-exported: callers import them here
from bootstrap.engine.sampling.params import MAX_SEED as MAX_SEED
from bootstrap.engine.sampling.params import SamplingParams as SamplingParams
from bootstrap.engine.sampling.processing import (
    History,
    TokenLogprob,
    needs_processing,
    on_device,
    process,
    token_logprobs,
)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None (use the global RNG)."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def generator_at(generator: torch.Generator | None, seed: int | None, position: int) -> torch.Generator | None:
    """``generator`` reseeded for a request's output token at ``position`` (None stays None): a
    seeded token's draw then depends on its seed and position alone, not on what shares its
    batch, where step boundaries fall, or whether a draft speculated (``spec.speculator``)."""
    if generator is None or seed is None:
        return generator
    mixed = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF  # splitmix64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return generator.manual_seed((mixed ^ (mixed >> 31)) & MAX_SEED)


def exponential_noise(
    like: torch.Tensor, generator: torch.Generator | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exponential(1) noise shaped like ``like`` (in ``out`` when given), from ``generator``
    where given, never 0 (a 0 would divide 0 into NaN): what sampling races ``probs`` with."""
    noise = torch.empty_like(like) if out is None else out
    return noise.exponential_(generator=generator).clamp_(min=torch.finfo(noise.dtype).tiny)


@dataclass(frozen=True)
class Sampled:
    """A step's tokens ``[B]`` and, per row, its ``TokenLogprob`` (None where not asked)."""

    tokens: torch.Tensor
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Turns a batch of logits into one token id per row, each row by its own parameters."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History] | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Token ids ``[B]`` (long) for ``logits [B, V]``; one params and generator per row, and
        one ``History`` per row when a row uses penalties or ``min_tokens`` (``eos_token_ids``
        are what ``min_tokens`` holds back)."""
        self._check_batch(logits, params, generators)
        logits = self._processed(logits, params, histories, eos_token_ids)
        tokens = argmax(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            index = on_device(rows, logits.device)
            drawn = self._draw(
                logits.index_select(0, index).float(),
                [params[i] for i in rows],
                [generators[i] for i in rows],
            )
            tokens = tokens.index_copy(0, index, drawn)
        return tokens.long()

    def sample_with_logprobs(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History] | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> Sampled:
        """``sample``, plus each asking row's logprobs under the raw ``logits`` (the model's own
        distribution: before temperature, penalties and filters)."""
        tokens = self.sample(logits, params, generators, histories, eos_token_ids)
        return Sampled(tokens, token_logprobs(logits, tokens, params))

    @staticmethod
    def _processed(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History] | None,
        eos_token_ids: set[int] | frozenset[int],
    ) -> torch.Tensor:
        """``logits`` with penalties and the ``min_tokens`` mask applied to the rows that need
        them (as float32); the same tensor when no row does."""
        if histories is not None and len(histories) != len(params):
            raise ValueError(f"need one History per logits row: rows={len(params)}, histories={len(histories)}")
        rows = [i for i, p in enumerate(params) if needs_processing(p, None if histories is None else histories[i])]
        if not rows:
            return logits
        if histories is None:
            raise ValueError("penalties and min_tokens need one History per logits row")
        index = on_device(rows, logits.device)
        part = process(
            logits.index_select(0, index).float(),
            [params[i] for i in rows],
            [histories[i] for i in rows],
            eos_token_ids,
        )
        return logits.float().index_copy(0, index, part)

    @staticmethod
    def _check_batch(logits: torch.Tensor, params: Sequence, generators: Sequence) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                f"need one SamplingParams and one generator per logits row: rows="
                f"{logits.shape[0]}, params={len(params)}, generators={len(generators)}"
            )

    def probabilities(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """``[B, V]`` float32: each sampled row's distribution after its temperature, ``min_p``,
        top-k and top-p, the one ``sample`` draws from (speculative decoding's ``p`` and ``q``;
        rows that need penalties or ``min_tokens`` are not handled here)."""
        logits = logits.float()
        temps = self._column([p.temperature for p in params], logits).clamp_(min=torch.finfo(logits.dtype).tiny)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temps
        if any(p.min_p > 0 for p in params):
            logits = self._min_p(logits, params)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = self._filter(logits, params)
        return torch.softmax(logits, dim=-1)

    def _draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        # Shift each row's maximum to 0 before dividing, and keep temperatures above the float
        # range's smallest normal, so a tiny temperature gives -inf (not inf - inf = NaN) away
        # from the maximum: effectively greedy, as it should be.
        probs = self.probabilities(logits, params)
        noise = self._exponential_noise(probs, generators)
        return argmax(probs / noise)

    @staticmethod
    def _column(values: list, like: torch.Tensor) -> torch.Tensor:
        return on_device(values, like.device, like.dtype).unsqueeze(1)

    def _min_p(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Mask (to -inf) what is less likely than ``min_p`` times the row's top probability.
        ``logits`` have their row maximum at 0, so that is ``logit < log(min_p)``; the top
        token (at 0) always stays."""
        min_ps = self._column([p.min_p for p in params], logits)
        below = (logits < min_ps.log()) & (logits < 0)
        return logits.masked_fill(below, float("-inf"))

    def _filter(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Mask (to -inf) what falls outside each row's top-k and top-p; the most likely token
        always stays, so no row is left empty (a ``top_p`` below float32's range rounds to 0)."""
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = self._column([p.top_k if p.top_k > 0 else vocab for p in params], logits)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_ps = self._column([p.top_p for p in params], logits)
        outside = (mass_before >= top_ps) & (top_ps < 1) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        noise = exponential_noise(probs)
        for row, gen in enumerate(generators):
            if gen is not None:
                exponential_noise(noise[row], gen, out=noise[row])
        return noise


def stop_reason(
    token_ids: list[int], text: str, params: SamplingParams, eos_token_ids: set[int], stop_from: int = 0
) -> str | None:
    """Why a request with these generated tokens and text should finish, or None to go on.

    ``"stop"`` for a stop token, EOS (unless ``ignore_eos``) or a stop string in ``text`` that
    ends after ``stop_from`` (where the ``min_tokens``-th token's text starts: earlier ones are
    ignored, as vLLM does), once at least ``min_tokens`` tokens were generated; otherwise
    ``"length"`` once ``max_tokens`` tokens were generated.
    """
    if len(token_ids) < params.min_tokens:
        return None
    if token_ids:
        last = token_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return "stop"
    if _stop_cuts(text, params, stop_from):
        return "stop"
    if len(token_ids) >= params.max_tokens:
        return "length"
    return None


def model_eos_ids(model: object) -> set[int]:
    """EOS token ids from a transformers model's generation config, else its config."""
    generation = getattr(model, "generation_config", None)
    value = getattr(generation, "eos_token_id", None)
    if value is None:
        value = getattr(model.config.get_text_config(), "eos_token_id", None)  # type: ignore[attr-defined]
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def trim_stop_text(text: str, params: SamplingParams, stop_from: int = 0) -> str:
    """``text`` cut just before the earliest stop string in it that ends after ``stop_from`` (OpenAI semantics)."""
    cuts = _stop_cuts(text, params, stop_from)
    return text[: min(cuts)] if cuts else text


def _stop_cuts(text: str, params: SamplingParams, stop_from: int) -> list[int]:
    """Where each stop string first occurs in ``text`` ending after ``stop_from``."""
    if not params.stop:  # most requests: every token comes here
        return []
    found = (text.find(s, max(stop_from - len(s) + 1, 0)) for s in params.stop)
    return [i for i in found if i >= 0]
