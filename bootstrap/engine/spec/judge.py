"""A speculative step's draws and verdict by request kind: greedy rows keep the target's argmax,
sampled rows the accept/reject rule (``spec.verify``), and seeded rows race the same exponential
noise the sampler would at each output position, so a proposal is kept only when it is the
token the target alone would have drawn: a seeded request's tokens then depend on its seed, not
on its batch or on the draft."""

from __future__ import annotations

import torch

from bootstrap.engine.request.sequence import Sequence
from bootstrap.engine.sampling.argmax import argmax
from bootstrap.engine.sampling.sampler import Sampler, exponential_noise, generator_at
from bootstrap.engine.spec.verify import Verdict, accept_greedy, accept_matching, accept_sampled


def draw(seq: Sequence, probs: torch.Tensor, ahead: int) -> torch.Tensor:
    """The draft's proposal for ``seq``'s output token ``ahead`` tokens past its last."""
    if seq.params.greedy:
        return argmax(probs)
    if seeded(seq):  # the race the target's pick at this position runs (``judge``)
        return argmax(probs / noise(seq, ahead, probs))
    return torch.multinomial(probs, 1)[0]


def judge(
    sampler: Sampler,
    seqs: list[Sequence],
    proposals: torch.Tensor,
    q: torch.Tensor | None,
    logits: torch.Tensor,
    limits: torch.Tensor,
) -> Verdict:
    """The verdict on ``proposals`` ``[B, k]`` from the target's ``logits`` ``[B, k + 1, V]``
    (``q``: the draft's distributions, None for an all-greedy batch), at most ``limits`` kept."""
    k = proposals.shape[1]
    if q is None:
        return accept_greedy(proposals, logits, limits)
    params = [seq.params for seq in seqs for _ in range(k + 1)]
    p = sampler.probabilities(logits.reshape(len(seqs) * (k + 1), -1), params).view(len(seqs), k + 1, -1)
    greedy = torch.tensor([seq.params.greedy for seq in seqs], device=logits.device)
    verdict = accept_sampled(proposals, q, p, [None] * len(seqs), limits)  # seeded rows: judged below
    if greedy.any():
        exact = accept_greedy(proposals, logits, limits)  # greedy rows of a mixed batch
        verdict = Verdict(
            torch.where(greedy, exact.accepted, verdict.accepted),
            torch.where(greedy[:, None], exact.tokens, verdict.tokens),
        )
    rows = [b for b, seq in enumerate(seqs) if seeded(seq)]
    if not rows:
        return verdict
    index = torch.tensor(rows, device=logits.device)  # each position picked as the sampler would
    picks = torch.stack([argmax(p[b] / torch.stack([noise(seqs[b], j, p[b, j]) for j in range(k + 1)])) for b in rows])
    matched = accept_matching(proposals.index_select(0, index), picks, limits.index_select(0, index))
    return Verdict(
        verdict.accepted.index_copy(0, index, matched.accepted),
        verdict.tokens.index_copy(0, index, matched.tokens),
    )


def seeded(seq: Sequence) -> bool:
    return seq.generator is not None and not seq.params.greedy


def noise(seq: Sequence, ahead: int, like: torch.Tensor) -> torch.Tensor:
    """The noise the sampler races ``seq``'s output token ``ahead`` tokens past its last with:
    its seed's, at that position."""
    position = seq.num_tokens - seq.num_prompt_tokens + ahead
    return exponential_noise(like, generator_at(seq.generator, seq.params.seed, position))
