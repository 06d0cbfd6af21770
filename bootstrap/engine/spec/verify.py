"""Speculative decoding's acceptance rules (the step around them: ``spec.speculator``): which of
a draft's ``k`` proposals the target keeps, and the token after them, for rows of one ``k``. The
verify pass gives the target's distribution at ``k + 1`` positions, ``i`` after ``i`` proposals.

- **Greedy** (``accept_greedy``): keep the longest prefix equal to the target's argmax, then take
  the target's argmax after it (a correction, or a bonus token when all ``k`` are kept): the
  output is greedy decoding's with the target alone, token for token.
- **Sampling** (``accept_sampled``; Leviathan et al. 2023, Chen et al. 2023): proposal ``x_i``
  drawn from the draft's ``q_i`` is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the
  first rejection the next token is drawn from ``max(0, p_i - q_i)`` normalized (``p_i`` itself
  where that is all zero), after ``k`` kept from ``p_k``. Every token is distributed as the
  target's own sampling (``p``, ``q``: after temperature and filters).
- **Seeded** (``accept_matching``): draft and target pick by the sampler's race with the seeded
  noise of each position, judged as greedy: the target's own seeded output, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bootstrap.engine.sampling.argmax import argmax


@dataclass(frozen=True)
class Verdict:
    """``accepted``: [B] draft tokens kept per row (0 to k); ``tokens``: [B, k + 1], the kept
    draft tokens then the next token, what follows them in a row being padding (``-1``)."""

    accepted: torch.Tensor
    tokens: torch.Tensor

    def new_tokens(self) -> list[list[int]]:
        """Each row's new tokens (``accepted[b] + 1`` of them), as Python lists."""
        return self.to_host().new_tokens()

    def to_host(self) -> HostVerdict:
        """Start the verdict's one copy to the host without waiting for it (into pinned memory
        on CUDA), so more work can be queued on the device before the host waits."""
        rows = torch.cat([self.accepted[:, None] + 1, self.tokens], dim=1)
        if not rows.is_cuda:
            return HostVerdict(rows, None)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return HostVerdict(host, copied)


@dataclass(frozen=True)
class HostVerdict:
    """A verdict's rows on their way to the host: ``[B, k + 2]``, each row's count of new tokens
    then its tokens; ``copied`` (None off CUDA) is recorded once the copy is queued."""

    rows: torch.Tensor
    copied: torch.cuda.Event | None

    def new_tokens(self) -> list[list[int]]:
        """Each row's new tokens, once the copy has landed (the one wait for the device)."""
        if self.copied is not None:
            self.copied.synchronize()
        return [row[1 : 1 + row[0]] for row in self.rows.tolist()]


def accept_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, limits: torch.Tensor | None = None
) -> Verdict:
    """``draft_tokens`` [B, k] against ``target_logits`` [B, k + 1, V]: see the module docstring.
    ``limits`` [B]: row ``b`` considers only its first ``limits[b]`` proposals (the rest are
    padding: a request that speculates less this step)."""
    _check(draft_tokens, target_logits)
    return accept_matching(draft_tokens, argmax(target_logits), limits)


def accept_matching(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, limits: torch.Tensor | None = None
) -> Verdict:
    """``draft_tokens`` [B, k] against the tokens the target picks ``target_tokens`` [B, k + 1]
    (its argmax, or a seeded row's race): the longest prefix equal to them, then the target's
    token after it; ``limits`` as in ``accept_greedy``."""
    rows, k = draft_tokens.shape
    if target_tokens.shape != (rows, k + 1):
        raise ValueError(f"target_tokens must be [{rows}, {k + 1}], got {list(target_tokens.shape)}")
    accepted = _kept_prefix(_within(draft_tokens == target_tokens[:, :k], limits))
    return Verdict(accepted, _assemble(draft_tokens, accepted, target_tokens.gather(1, accepted[:, None])[:, 0]))


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    limits: torch.Tensor | None = None,
) -> Verdict:
    """``draft_tokens`` [B, k] drawn from ``draft_probs`` [B, k, V], against ``target_probs``
    [B, k + 1, V], one generator (or None) per row, ``limits`` as in ``accept_greedy``: see the
    module docstring (a row that keeps all of its ``limits[b]`` draws its bonus token from ``p``)."""
    rows, k = _check(draft_tokens, target_probs)
    if draft_probs.shape != (rows, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [{rows}, {k}, {target_probs.shape[-1]}], got {list(draft_probs.shape)}")
    if len(generators) != rows:
        raise ValueError(f"one generator (or None) per row: {rows} rows, {len(generators)} generators")
    p = target_probs[:, :k].gather(2, draft_tokens[..., None])[..., 0]
    q = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    uniform = torch.stack([_uniform(k, g, target_probs.device) for g in generators]) if k else p
    kept = uniform * q < p  # u < p / q without dividing; a token the draft could not draw (q = 0) is never kept
    accepted = _kept_prefix(_within(kept, limits))
    ends = [k] * rows if limits is None else limits.tolist()
    nxt = torch.empty(rows, dtype=torch.long, device=target_probs.device)
    for row, (n, end, generator) in enumerate(zip(accepted.tolist(), ends, generators)):
        target = target_probs[row, n]
        if n < end:  # rejected at n: the residual; else every considered proposal was kept: a bonus from p
            residual = (target - draft_probs[row, n]).clamp_min(0)
            target = residual if residual.sum() > 0 else target
        nxt[row] = torch.multinomial(target / target.sum(), 1, generator=generator)[0]
    return Verdict(accepted, _assemble(draft_tokens, accepted, nxt))


def _check(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"draft_tokens must be [B, k] and the target's scores [B, k + 1, V], got "
            f"{list(draft_tokens.shape)} and {list(target.shape)}"
        )
    rows, k = draft_tokens.shape
    if target.shape[:2] != (rows, k + 1):
        raise ValueError(
            f"the target's scores must be [{rows}, {k + 1}, V] for {k} draft tokens, got {list(target.shape)}"
        )
    return rows, k


def _within(kept: torch.Tensor, limits: torch.Tensor | None) -> torch.Tensor:
    """``kept`` with every position at or past its row's limit false."""
    if limits is None:
        return kept
    position = torch.arange(kept.shape[1], device=kept.device)
    return kept & (position < limits.to(kept.device)[:, None])


def _kept_prefix(kept: torch.Tensor) -> torch.Tensor:
    """[B, k] booleans to [B]: how many lead before the first False."""
    return kept.long().cumprod(dim=1).sum(dim=1)


def _uniform(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.rand(count, generator=generator, device=generator.device if generator is not None else device).to(
        device
    )


def _assemble(draft_tokens: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: the kept draft tokens, then ``nxt``, then -1."""
    rows, k = draft_tokens.shape
    position = torch.arange(k + 1, device=draft_tokens.device).expand(rows, k + 1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((rows, 1), -1)], dim=1)
    out = torch.where(position < accepted[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, accepted[:, None], nxt[:, None])
