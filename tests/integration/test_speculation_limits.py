"""Where speculative decoding must hold back (``Speculator.plan``), on the real CPU engine with a
draft that always agrees (the target's own weights): a request that asks for logprobs, uses a
penalty or has ``min_tokens`` pending never shares a speculative step and gets what it gets
without a draft (a request beside it speculates once it is gone); ``n`` choices fork both pools
and each choice gets what it gets alone without a draft; and a step near ``max_tokens`` speculates
no deeper than the request's KV reservation holds, in both pools, at its peak (the pools'
allocations watched as they happen: the text a too-deep step writes is trimmed away after)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
from test_engine_speculation import PROMPTS, TPB, empty, executor, model

from bootstrap.engine import SamplingParams
from bootstrap.engine.request.sequence import Sequence, next_request_id
from bootstrap.engine.step.batch import ScheduledBatch

COMPANION = SamplingParams(max_tokens=30, temperature=0)  # speculates whenever its batch may


def greedy_tokens(target, prompt, max_tokens):
    plain = executor(target)
    try:
        return plain.await_response(plain.enqueue(prompt, SamplingParams(max_tokens=max_tokens)), timeout=120).token_ids
    finally:
        plain.shutdown()


def restricted(case: str, greedy: list[int]) -> SamplingParams:
    if case == "logprobs":
        return SamplingParams(max_tokens=12, logprobs=2)
    if case == "repetition_penalty":
        return SamplingParams(max_tokens=12, repetition_penalty=1.5)
    if case == "frequency_penalty":
        return SamplingParams(max_tokens=12, temperature=0.8, seed=3, frequency_penalty=1.5)
    # min_tokens holds back a stop token the target picks third: greedy speculation would stop there
    return SamplingParams(max_tokens=12, min_tokens=8, stop_token_ids=[greedy[2]])


def run_with_companion(ex, params):
    """The restricted request and a plain greedy one beside it; both responses, and the output
    lengths of the restricted request at each speculative step it was in."""
    speculator, seen = ex.speculator, []
    request = ex.enqueue(PROMPTS[1], params)
    if speculator is not None:
        step = speculator.step

        def spy(batch, limits):
            seen.extend(len(s.output_token_ids) for s in batch.seqs if s.request_id == request)
            return step(batch, limits)

        speculator.step = spy
    companion = ex.enqueue(PROMPTS[0], COMPANION)
    return ex.await_response(request, timeout=120), ex.await_response(companion, timeout=120), seen


@pytest.mark.parametrize("case", ["logprobs", "repetition_penalty", "frequency_penalty", "min_tokens"])
def test_a_request_that_must_not_speculate_never_shares_a_speculative_step(case):
    target = model("llama", 1)
    params = restricted(case, greedy_tokens(target, PROMPTS[1], 12))
    plain = executor(target)
    try:
        want, want_companion, _ = run_with_companion(plain, params)
    finally:
        plain.shutdown()
    ex = executor(target, target)
    try:
        got, companion, seen = run_with_companion(ex, params)
        assert got.token_ids == want.token_ids and companion.token_ids == want_companion.token_ids
        if case == "logprobs":
            assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
            assert [lp.token_id for lp in got.logprobs] == got.token_ids
        if case == "min_tokens":  # it speculates once its min_tokens are out, and before that not
            assert len(got.token_ids) > 8 and all(n >= 8 for n in seen)
        else:
            assert seen == []
        assert ex.speculator.stats.steps > 0 and empty(ex)  # the companion speculated on its own
    finally:
        ex.shutdown()


def test_choices_fork_both_pools_and_each_gets_what_it_gets_alone_without_a_draft():
    target = model("llama", 1)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=41)
    plain = executor(target)
    try:
        alone = [
            plain.await_response(plain.enqueue(PROMPTS[2], dataclasses.replace(params, seed=41 + i)), timeout=120)
            for i in range(3)
        ]
    finally:
        plain.shutdown()
    ex = executor(target, target)
    try:
        choices = [ex.await_response(i, timeout=120) for i in ex.enqueue_choices(PROMPTS[2], params, 3)]
        assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
        assert len({tuple(c.token_ids) for c in choices}) == 3 and empty(ex)
        stats = ex.speculator.stats
        assert stats.steps > 0 and stats.acceptance_rate == 1.0  # each choice's draft pool holds its prompt
    finally:
        ex.shutdown()


def decoding(params: SamplingParams, generated: int = 1) -> Sequence:
    """A request in decode: ``PROMPTS[1]`` and ``generated`` tokens, all but the last computed."""
    seq = Sequence(next_request_id(), list(PROMPTS[1]), params)
    for token in range(generated):
        seq.append(token + 3)
    seq.num_computed = seq.num_tokens - 1
    return seq


def test_plan_makes_a_step_ordinary_when_any_of_its_requests_must_not_speculate():
    """``plan`` itself: one request with logprobs, a penalty, ``min_tokens`` pending, forks it
    still carries or rows shared with forks makes the whole step ordinary; otherwise the depth
    is what the request with the least room left may write."""
    ex = executor(model("llama", 1), model("llama", 2), k=4)
    plan = ex.speculator.plan
    try:
        plain = decoding(SamplingParams(max_tokens=30))
        assert plan(ScheduledBatch([plain], [1])) == [4]
        carrying = decoding(SamplingParams(max_tokens=30))
        carrying.forks = [Sequence(next_request_id(), list(PROMPTS[1]), SamplingParams(max_tokens=30))]
        for other in (
            decoding(SamplingParams(max_tokens=30, logprobs=0)),
            decoding(SamplingParams(max_tokens=30, presence_penalty=0.5)),
            decoding(SamplingParams(max_tokens=30, min_tokens=3), generated=2),
            carrying,
        ):
            assert plan(ScheduledBatch([plain, other], [1, 1])) is None
        assert plan(ScheduledBatch([plain, decoding(SamplingParams(max_tokens=30, min_tokens=3), 3)], [1, 1])) == [4, 4]
        assert plan(ScheduledBatch([plain, plain], [1, 1], [0, 0])) is None  # a fork's step: rows shared
        near_end = decoding(SamplingParams(max_tokens=5), generated=2)  # 3 tokens to go: 2 proposals at most
        assert plan(ScheduledBatch([plain, near_end], [1, 1])) == [2, 2]
        assert plan(ScheduledBatch([decoding(SamplingParams(max_tokens=5), generated=4)], [1])) is None
    finally:
        ex.shutdown()


def watch_peaks(pool) -> dict[int, tuple[int, int]]:
    """Each request's most tokens and blocks in ``pool``, recorded as the pool allocates (the
    real allocations, run as they are)."""
    peaks: dict[int, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for name, real in [(name, getattr(pool, name)) for name in ("allocate", "extend", "fork")]:

        def spy(first, *rest, real=real, name=name):
            table = real(first, *rest)
            held = rest[0] if name == "fork" else first
            tokens, blocks = peaks[held]
            peaks[held] = (max(tokens, pool.num_tokens(held)), max(blocks, len(pool.block_table(held))))
            return table

        setattr(pool, name, spy)
    return peaks


def test_a_speculative_step_near_max_tokens_stays_inside_the_kv_reservation_in_both_pools():
    """k = 4, a 5-token prompt: every step keeps all 4 proposals and adds the target's token, so
    the steps after the prefill start at 1, 6, 11, 16 and 21 tokens out; with ``max_tokens`` 24
    the reservation is 28 slots (7 blocks of 4), and a last step of full depth would write 30."""
    target = model("llama", 1)
    ex = executor(target, target, k=4)
    peaks = {"target": watch_peaks(ex.runner.kv_cache), "draft": watch_peaks(ex.speculator.pool)}
    limits = []
    step = ex.speculator.step
    ex.speculator.step = lambda batch, depth: limits.append(list(depth)) or step(batch, depth)
    try:
        params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=40)]
        ids = [ex.enqueue(PROMPTS[0], params[0]), ex.enqueue(PROMPTS[0][:3], params[1])]
        got = [ex.await_response(i, timeout=120).token_ids for i in ids]
        assert empty(ex)
    finally:
        ex.shutdown()
    assert got == [greedy_tokens(target, PROMPTS[0], 24), greedy_tokens(target, PROMPTS[0][:3], 40)]
    assert any(0 < max(depth) < 4 for depth in limits)  # a step held back by the request near its end
    for request, prompt, p in zip(ids, (5, 3), params):
        reserved = prompt + p.max_tokens - 1  # every token but the last one: 28 and 42 slots
        for name, pool_peaks in peaks.items():
            tokens, blocks = pool_peaks[request]
            assert tokens <= reserved and blocks <= -(-reserved // TPB), (name, request, tokens, reserved)
    assert peaks["target"][ids[0]] == (28, 7)  # it did reach its reservation: the cap is tight, not loose
