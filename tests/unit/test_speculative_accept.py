"""Speculative decoding's acceptance rules (``bootstrap.engine.spec.verify``). Greedy: the new
tokens are exactly the target's greedy continuation, for any draft. Sampling: the output tokens
are distributed as the target's, checked with a chi-square test on a 5-token vocabulary over
40,000 seeded rows at significance 0.001; a seeded row repeats whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.engine.request.acceptance import Acceptance
from bootstrap.engine.spec.depth import StepCosts, best_depth, expected_tokens
from bootstrap.engine.spec.verify import accept_greedy, accept_sampled

CHI2_999 = {4: 18.467}  # chi-square critical values at p = 0.999 by degrees of freedom (scipy.stats.chi2.ppf)


def logits_with_argmax(best: list[list[int]], vocab: int = 8) -> torch.Tensor:
    out = torch.randn(len(best), len(best[0]), vocab)
    for b, row in enumerate(best):
        for i, token in enumerate(row):
            out[b, i, token] = 10.0
    return out


def test_greedy_keeps_the_matching_prefix_then_the_targets_own_next_token():
    target = logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[1, 2, 3], [1, 5, 3], [6, 2, 3]])  # all kept; a miss at 1; a miss at 0
    verdict = accept_greedy(draft, target)
    assert verdict.accepted.tolist() == [3, 1, 0]
    assert verdict.new_tokens() == [[1, 2, 3, 4], [1, 2], [1]]  # the bonus token; two corrections
    assert verdict.tokens.tolist()[2] == [1, -1, -1, -1]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4), st.integers(1, 4), st.integers(0, 2**31 - 1), st.floats(0.0, 1.0))
def test_greedy_output_is_the_targets_greedy_continuation_for_any_draft(k, rows, seed, miss_rate):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(rows, k + 1, 7, generator=generator)
    best = target.argmax(-1)
    misses = torch.rand(rows, k, generator=generator) < miss_rate
    draft = torch.where(misses, (best[:, :k] + 1) % 7, best[:, :k])
    verdict = accept_greedy(draft, target)
    for row, tokens in enumerate(verdict.new_tokens()):
        assert tokens == best[row, : len(tokens)].tolist()  # exactly greedy decoding's tokens
        assert len(tokens) == 1 + int((~misses[row]).long().cumprod(0).sum())  # the draft's lead before its first miss


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_output_tokens_are_distributed_as_the_target():
    torch.manual_seed(2026)
    rows, k, vocab = 40_000, 3, 5
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, -1)  # the target at each position (independent of the prefix)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, -1)  # a draft that differs from it
    draft = torch.stack([torch.multinomial(q[i], rows, replacement=True) for i in range(k)], dim=1)
    verdict = accept_sampled(draft, q.expand(rows, k, vocab), p.expand(rows, k + 1, vocab), [None] * rows)
    new = verdict.tokens
    assert 0 < verdict.accepted.float().mean() < k  # some kept, some rejected: both paths run
    for position in range(k + 1):
        produced = verdict.accepted >= position  # rows that reached this position
        if produced.sum() < 2_000:
            continue
        statistic = chi_square(new[produced, position], p[position])
        assert statistic < CHI2_999[vocab - 1], (position, statistic)
    # the acceptance rate is what theory says: E[min(1, p/q)] under q = sum(min(p, q)) per position
    first_kept = (verdict.accepted >= 1).float().mean()
    assert abs(first_kept - torch.minimum(p[0], q[0]).sum()) < 0.01


def test_a_draft_equal_to_the_target_is_always_kept_and_a_seeded_row_repeats_in_any_batch():
    p = torch.softmax(torch.randn(1, 4, 6), -1)
    draft = torch.tensor([[2, 3, 1]])
    always = accept_sampled(draft, p[:, :3], p, [torch.Generator().manual_seed(1)])
    assert always.accepted.tolist() == [3]
    q = torch.softmax(torch.randn(1, 3, 6), -1)
    alone = accept_sampled(draft, q, p, [torch.Generator().manual_seed(9)])
    batch = accept_sampled(
        draft.repeat(3, 1), q.repeat(3, 1, 1), p.repeat(3, 1, 1), [torch.Generator().manual_seed(s) for s in (4, 9, 5)]
    )
    assert batch.new_tokens()[1] == alone.new_tokens()[0]


def test_shapes_that_do_not_fit_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"must be \[2, 4, V\] for 3 draft tokens"):
        accept_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="one generator"):
        accept_sampled(
            torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1, 3), 1 / 3), torch.full((2, 2, 3), 1 / 3), [None]
        )


def test_limits_make_a_row_consider_only_its_first_proposals():
    target = logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [9, 9, 9]])
    verdict = accept_greedy(draft, target, limits=torch.tensor([3, 1, 0]))
    assert verdict.new_tokens() == [[1, 2, 3, 4], [1, 2], [1]]  # row 1 stops after its one proposal: its bonus
    torch.manual_seed(3)
    rows, vocab = 40_000, 5
    p = torch.softmax(torch.randn(3, vocab), -1)
    q = torch.softmax(torch.randn(2, vocab), -1)
    draft = torch.stack([torch.multinomial(q[i], rows, replacement=True) for i in range(2)], dim=1)
    limited = accept_sampled(
        draft,
        q.expand(rows, 2, vocab),
        p.expand(rows, 3, vocab),
        [None] * rows,
        limits=torch.ones(rows, dtype=torch.long),
    )
    assert limited.accepted.max() == 1
    second = limited.tokens[limited.accepted == 1, 1]  # the bonus after the one kept proposal: drawn from p[1]
    assert chi_square(second, p[1]) < CHI2_999[vocab - 1]


def test_best_depth_speculates_as_deep_as_acceptance_pays_for_and_not_at_all_when_it_does_not():
    cheap = StepCosts(prior=0.1)  # nothing measured: a verify pass as a decode step, a draft pass a tenth of one
    assert best_depth(1.0, cheap, 8) == 8 and best_depth(0.0, cheap, 8) == 0
    assert best_depth(0.8, cheap, 8) in (4, 5, 6) and best_depth(0.5, cheap, 8) in (1, 2, 3)
    assert best_depth(0.9, StepCosts(prior=1.0), 8) == 0  # a draft as costly as the target never pays
    assert (
        best_depth(0.6, StepCosts(0.05), 8)
        < best_depth(0.8, StepCosts(0.05), 8)
        <= best_depth(0.95, StepCosts(0.05), 8)
    )


def test_measured_costs_decide_and_a_slow_verify_pass_turns_speculation_off():
    costs = StepCosts(prior=0.15)
    assert best_depth(0.8, costs, 8) > 0
    costs.record("decode", 0.005)  # a captured decode step: 5 ms
    costs.record("verify", 0.030)  # an eager verify pass: 30 ms
    costs.record("draft", 0.010)
    assert costs.of() == (0.005, 0.030, 0.010)
    assert best_depth(1.0, costs, 8) == 0  # even a draft that always agrees cannot pay for these passes
    costs.record("verify", 0.005)  # decayed averages: 0.7 of the old, 0.3 of the new
    assert costs.verify == pytest.approx(0.7 * 0.030 + 0.3 * 0.005)


def test_a_requests_acceptance_follows_what_its_steps_keep():
    record = Acceptance()
    assert record.rate == pytest.approx(0.8)  # the prior: a new request speculates
    for _ in range(20):
        record.observe(4, 0)  # nothing kept
    assert record.rate < 0.05
    for _ in range(20):
        record.observe(4, 4)  # all kept: no failure observed
    assert record.rate > 0.95


def test_decode_and_draft_figures_fall_at_once_and_rise_by_the_decay():
    """A first decode step that carried a one-time cost must not keep speculating looking cheap,
    nor a first draft pass that did keep it looking dear: those figures take a lower measurement
    at once; a higher one, and any verify measurement, move by the decay."""
    costs = StepCosts(prior=0.1)
    for what in ("decode", "draft"):
        costs.record(what, 0.018)
        costs.record(what, 0.005)
        assert getattr(costs, what) == 0.005
        costs.record(what, 0.010)
        assert getattr(costs, what) == pytest.approx(0.7 * 0.005 + 0.3 * 0.010)
    costs.record("verify", 0.010)
    costs.record("verify", 0.004)
    assert costs.verify == pytest.approx(0.7 * 0.010 + 0.3 * 0.004)


def test_best_depth_is_the_argmax_of_the_expected_rate_and_rises_with_acceptance():
    """Against the definition (tokens a step over its cost, every depth in turn), on a grid of
    acceptances, costs and ceilings: the depth chosen gives the most (to 1e-9), and never falls
    as acceptance rises."""
    figures = [(1.0, 1.0, 0.05), (5.6, 5.4, 0.65), (6.9, 6.3, 0.75), (1.0, 1.3, 0.3), (1.0, 1.0, 1.0)]
    for decode, verify, draft in figures:
        costs = StepCosts(0.1, decode, verify, draft)
        for ceiling in (1, 4, 8):
            depths = []
            for step in range(101):
                rate = step / 100
                value = [1.0] + [
                    expected_tokens(rate, k) * decode / (verify + draft * k) for k in range(1, ceiling + 1)
                ]
                chosen = best_depth(rate, costs, ceiling)
                assert value[chosen] >= max(value) - 1e-9, (rate, decode, verify, draft, ceiling)
                depths.append(chosen)
            assert depths == sorted(depths) and depths[0] == 0
