"""Speculative decoding's acceptance rules: which of a draft's ``k`` proposed tokens the target
keeps, and the token that comes after the kept ones. A batch of rows at once, ``k`` the same
for every row of the call.

The target has scored the row's last token and the ``k`` draft tokens in one forward, so it has
a distribution at ``k + 1`` positions: position ``i`` is the target's next-token distribution
after the first ``i`` draft tokens.

- **Greedy** (``accept_greedy``): keep the longest prefix of draft tokens that equal the
  target's argmax at their position, then take the target's argmax after it (a correction at
  the first miss, a bonus token when all ``k`` are kept). Every kept or added token is the one
  greedy decoding with the target alone would produce, so the output is identical to it.
- **Sampling** (``accept_sampled``; Leviathan et al. 2023, Chen et al. 2023): draft token
  ``x_i``, drawn from the draft's distribution ``q_i``, is kept with probability
  ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the next token is drawn from the
  residual ``max(0, p_i - q_i)``, normalized (from ``p_i`` itself when that is all zero, which
  only happens when ``p_i == q_i``); after ``k`` kept tokens a bonus token is drawn from
  ``p_k``. Every output token is then distributed exactly as sampling from the target
  (``p``: the target's distribution after its own temperature and filters, ``q`` the draft's
  under the same parameters). Each row draws from its own ``torch.Generator`` when it has one,
  so a seeded request repeats whatever else is in the batch.

``Verdict.tokens[b, : accepted[b] + 1]`` are row ``b``'s new tokens: the kept draft tokens, then
the correction or bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """``accepted``: [B] draft tokens kept per row (0 to k); ``tokens``: [B, k + 1], the kept
    draft tokens then the next token, what follows them in a row being padding (``-1``)."""

    accepted: torch.Tensor
    tokens: torch.Tensor

    def new_tokens(self) -> list[list[int]]:
        """Each row's new tokens (``accepted[b] + 1`` of them), as Python lists."""
        counts = (self.accepted + 1).tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), counts)]


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """``draft_tokens`` [B, k] against ``target_logits`` [B, k + 1, V]: see the module docstring."""
    rows, k = _check(draft_tokens, target_logits)
    best = target_logits.argmax(dim=-1)  # [B, k + 1]
    accepted = _kept_prefix(draft_tokens == best[:, :k])
    return Verdict(accepted, _assemble(draft_tokens, accepted, best.gather(1, accepted[:, None])[:, 0]))


def accept_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generators: Sequence[torch.Generator | None]) -> Verdict:  # fmt: skip
    """``draft_tokens`` [B, k] drawn from ``draft_probs`` [B, k, V], against ``target_probs``
    [B, k + 1, V], one generator (or None) per row: see the module docstring."""
    rows, k = _check(draft_tokens, target_probs)
    if draft_probs.shape != (rows, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [{rows}, {k}, {target_probs.shape[-1]}], got {list(draft_probs.shape)}")
    if len(generators) != rows:
        raise ValueError(f"one generator (or None) per row: {rows} rows, {len(generators)} generators")
    p = target_probs[:, :k].gather(2, draft_tokens[..., None])[..., 0]
    q = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    uniform = torch.stack([_uniform(k, g, target_probs.device) for g in generators]) if k else p
    kept = uniform * q < p  # u < p / q without dividing; a token the draft could not draw (q = 0) is never kept
    accepted = _kept_prefix(kept)
    nxt = torch.empty(rows, dtype=torch.long, device=target_probs.device)
    for row, (n, generator) in enumerate(zip(accepted.tolist(), generators)):
        target = target_probs[row, n]
        if n < k:
            residual = (target - draft_probs[row, n]).clamp_min(0)
            target = residual if residual.sum() > 0 else target
        nxt[row] = torch.multinomial(target / target.sum(), 1, generator=generator)[0]
    return Verdict(accepted, _assemble(draft_tokens, accepted, nxt))


def _check(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(f"draft_tokens must be [B, k] and the target's scores [B, k + 1, V], got "
                         f"{list(draft_tokens.shape)} and {list(target.shape)}")  # fmt: skip
    rows, k = draft_tokens.shape
    if target.shape[:2] != (rows, k + 1):
        raise ValueError(f"the target's scores must be [{rows}, {k + 1}, V] for {k} draft tokens, got {list(target.shape)}")
    return rows, k


def _kept_prefix(kept: torch.Tensor) -> torch.Tensor:
    """[B, k] booleans to [B]: how many lead before the first False."""
    return kept.long().cumprod(dim=1).sum(dim=1)


def _uniform(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.rand(count, generator=generator, device=generator.device if generator is not None else device).to(device)


def _assemble(draft_tokens: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: the kept draft tokens, then ``nxt``, then -1."""
    rows, k = draft_tokens.shape
    position = torch.arange(k + 1, device=draft_tokens.device).expand(rows, k + 1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((rows, 1), -1)], dim=1)
    out = torch.where(position < accepted[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, accepted[:, None], nxt[:, None])
