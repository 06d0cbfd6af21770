"""Logits processing for the batched sampler: penalties, ``min_tokens`` and logprobs.

Whole batches with a few tensor operations, only on the rows that ask (the sampler skips this
module when ``needs_processing`` finds no penalty and no unmet ``min_tokens``).

- **Repetition** (HF/vLLM), over the prompt and the generated tokens: a token seen has its
  logit divided by ``r`` when positive (capped at the largest finite float), times ``r`` otherwise.
- **Presence and frequency** (OpenAI), over the generated tokens only:
  ``logit[t] -= presence * (count[t] > 0) + frequency * count[t]``.
- **min_tokens**: until that many tokens were generated, EOS ids (unless ``ignore_eos``) and
  ``stop_token_ids`` get ``-inf``.

Token counts: one ``scatter_add_`` over a padded ``[R, L]`` tensor of ids. Logprobs are
``log_softmax`` of the raw logits, the model's own distribution (as vLLM returns by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class SamplingParams(Protocol):
    """The fields of ``bootstrap.engine.sampling.sampler.SamplingParams`` used here (a protocol, so this
    module does not import the one that imports it)."""

    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...


class History(NamedTuple):
    """One row's tokens so far: the prompt followed by the generated tokens, and how many more
    were sampled that are not in ``token_ids`` yet (in flight: counted, their ids unknown)."""

    token_ids: Sequence[int]
    num_prompt: int
    in_flight: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) + self.in_flight - self.num_prompt


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the ``top`` (token id, logprob) pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def needs_processing(p: SamplingParams, history: History | None) -> bool:
    """True when the row's logits must be changed before sampling this step."""
    if uses_penalties(p):
        return True
    return p.min_tokens > 0 and (history is None or history.num_generated < p.min_tokens)


def process(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    eos_token_ids: Sequence[int] | set[int] | frozenset[int],
) -> torch.Tensor:
    """Penalties, then the ``min_tokens`` mask, for float ``logits [R, V]`` (one row per params)."""
    if any(uses_penalties(p) for p in params):
        logits = _apply_penalties(logits, params, histories)
    return _mask_early_stops(logits, params, histories, eos_token_ids)


def _apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]
) -> torch.Tensor:
    vocab = logits.shape[-1]
    output = _counts([h.token_ids[h.num_prompt :] for h in histories], vocab, logits.device)
    if any(p.repetition_penalty != 1 for p in params):
        prompt = _counts([h.token_ids[: h.num_prompt] for h in histories], vocab, logits.device)
        r = _column([p.repetition_penalty for p in params], logits)
        seen = (prompt + output) > 0
        divided = (logits / r).clamp_(max=torch.finfo(logits.dtype).max)  # a tiny r: the largest finite, not inf
        logits = torch.where(seen, torch.where(logits > 0, divided, logits * r), logits)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
        presence = _column([p.presence_penalty for p in params], logits)
        frequency = _column([p.frequency_penalty for p in params], logits)
        counts = output.to(logits.dtype)
        logits = logits - presence * (counts > 0).to(logits.dtype) - frequency * counts
    return logits


def _counts(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` counts of each token id per row (ids outside the vocabulary are ignored)."""
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return torch.zeros(len(rows), vocab, dtype=torch.long, device=device)
    padded = torch.tensor([list(r) + [vocab] * (width - len(r)) for r in rows], dtype=torch.long)
    ids = padded.masked_fill_((padded < 0) | (padded > vocab), vocab).to(device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]


def _mask_early_stops(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    eos_token_ids: Sequence[int] | set[int] | frozenset[int],
) -> torch.Tensor:
    """``-inf`` for the stop and EOS ids of each row that has not generated ``min_tokens`` yet."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, h) in enumerate(zip(params, histories)):
        if h.num_generated < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ids = sorted(t for t in ids if 0 <= t < vocab)
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return logits
    index = (on_device(rows, logits.device), on_device(cols, logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def token_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """Per row: the chosen token's logprob and its top-``logprobs`` under the raw logits, or
    None for rows that did not ask. One ``log_softmax`` and one ``topk`` for the asking rows."""
    return logprob_entries(logprob_tensors(raw_logits, tokens, params), params)


def logprob_tensors(
    raw_logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, ...]:
    """``token_logprobs``' device work, no host sync: the chosen ids, their logprobs, the top
    values and ids of the asking rows (empty when no row asks)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return ()
    index = on_device(rows, raw_logits.device)
    logp = torch.log_softmax(raw_logits.index_select(0, index).float(), dim=-1)
    chosen = tokens.index_select(0, index).long()
    picked = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    k = min(max(params[i].logprobs for i in rows), logp.shape[-1])  # type: ignore[type-var]
    top_values, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    return chosen, picked, top_values, top_ids


def logprob_entries(tensors: Sequence[torch.Tensor], params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """``logprob_tensors``' results (on the host, or read there now) as one entry per row."""
    out: list[TokenLogprob | None] = [None] * len(params)
    if not tensors:
        return out
    chosen_l, picked_l, values_l, ids_l = (t.tolist() for t in tensors)
    for j, i in enumerate(i for i, p in enumerate(params) if p.logprobs is not None):
        n = params[i].logprobs or 0
        top = tuple(zip(ids_l[j][:n], values_l[j][:n]))
        out[i] = TokenLogprob(chosen_l[j], picked_l[j], top)
    return out


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    return on_device(values, like.device, like.dtype).unsqueeze(1)


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` on ``device`` without waiting: from pinned memory the copy is queued behind the
    device's work (a plain copy would wait for it, and a step launched early with it)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    return host.to(device, non_blocking=True)
