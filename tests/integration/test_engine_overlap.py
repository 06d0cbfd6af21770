"""Overlap scheduling (``SchedulerConfig.overlap``) on the CPU, against the same executor without
it: the same tokens, finishes and logprobs for greedy, seeded and penalised requests, ``n``
choices, stop ids, EOS, ``min_tokens`` and prefix hits, with requests arriving while others
decode; a request that stops wastes at most one step and emits nothing past its stop; and
after requests cancelled mid-flight, nothing is left in flight or in the pool."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers.tiny_llama import build_model, make_executor, reference

from bootstrap.engine import SamplingParams


@pytest.fixture(scope="module")
def model():
    return build_model()


def prompts_of(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(2, 30))] for _ in range(12)]


@pytest.fixture(scope="module")
def frequent(model) -> list[int]:
    """The tokens the model's greedy answers hold most often: EOS and a stop id that end requests."""
    counts = Counter(t for seed in (1, 2, 3) for p in prompts_of(seed) for t in reference(model, p, 10))
    return [token for token, _ in counts.most_common(2)]


def workload(seed: int, stop: int) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, n) of requests that cross every feature the overlap touches."""
    prompts = prompts_of(seed)
    shared = prompts[0][:2] + [11] * 16  # a prefix that fills whole blocks, for the prefix cache
    kinds = [
        SamplingParams(max_tokens=9, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=6, logprobs=3),
        SamplingParams(max_tokens=11, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,), min_tokens=2),
        SamplingParams(max_tokens=14, temperature=0.7, seed=9, presence_penalty=0.5),
        SamplingParams(max_tokens=6, temperature=0, logprobs=0),
        SamplingParams(max_tokens=13, temperature=0.9, seed=3, ignore_eos=True),
    ]
    out = [(p, kinds[i % len(kinds)], 1) for i, p in enumerate(prompts)]
    out += [([*shared, 5, 6], kinds[1], 3), ([*shared, 8], kinds[0], 2), (shared, kinds[4], 1)]
    return out


def outcome(model, frequent, overlap: bool, seed: int, prefix_caching: bool = True) -> tuple[list, int]:
    """Every response of the workload, half enqueued up front and half one by one as the
    engine steps (so prompts prefill beside decodes), and the number of forwards run."""
    ex = make_executor(
        model,
        batch=6,
        num_tokens=40,
        kv_tokens=1024,
        eos_token_ids={frequent[0]},
        overlap=overlap,
        prefix_caching=prefix_caching,
    )
    forwards = [0]
    run = ex.runner.run

    def counted(batch, *feed):
        forwards[0] += 1
        return run(batch, *feed)

    ex.runner.run = counted
    items, ids = workload(seed, frequent[1]), []
    for prompt, params, n in items[: len(items) // 2]:
        ids += ex.enqueue_choices(prompt, params, n)
    for prompt, params, n in items[len(items) // 2 :]:
        ex._loop.step_here()  # a round as the executor's waits run it
        ids += ex.enqueue_choices(prompt, params, n)
    answers = [ex.await_response(rid, timeout=60) for rid in ids]
    assert ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    assert all(not s.in_flight for s in ex.scheduler.running) and ex._loop.in_flight is None
    ex.shutdown()
    rows = [
        (a.token_ids, a.finish_reason, a.error, [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs or []])
        for a in answers
    ]
    return rows, forwards[0]


@pytest.mark.parametrize("seed", [1, 2])
def test_overlap_gives_the_tokens_finishes_and_logprobs_of_the_plain_loop(model, frequent, seed):
    plain, plain_forwards = outcome(model, frequent, False, seed)
    overlapped, overlapped_forwards = outcome(model, frequent, True, seed)
    assert [r[:3] for r in overlapped] == [r[:3] for r in plain]
    for got, want in zip(overlapped, plain):  # logprobs: the same ids, values as close as other batches give
        assert [(t, [i for i, _ in top]) for t, _, top in got[3]] == [(t, [i for i, _ in top]) for t, _, top in want[3]]
        values = [v for _, lp, top in got[3] for v in [lp, *(v for _, v in top)]]
        assert values == pytest.approx([v for _, lp, top in want[3] for v in [lp, *(v for _, v in top)]], abs=1e-4)
    assert all(error is None for _, _, error, _ in plain)
    assert {reason for _, reason, _, _ in plain} >= {"length", "stop"}  # both ends are crossed
    stops = sum(reason == "stop" for _, reason, _, _ in plain)
    assert plain_forwards <= overlapped_forwards <= plain_forwards + stops  # one wasted step a stop at most


def test_overlap_without_the_prefix_cache_matches_too(model, frequent):
    plain = outcome(model, frequent, False, 3, prefix_caching=False)[0]
    assert [r[:3] for r in outcome(model, frequent, True, 3, prefix_caching=False)[0]] == [r[:3] for r in plain]


def test_cancels_of_requests_in_flight_leave_no_token_block_or_handle(model):
    ex = make_executor(model, batch=4, num_tokens=32, kv_tokens=512, overlap=True)
    rng = random.Random(11)
    ids = [ex.enqueue([rng.randrange(3, 200) for _ in range(5)], SamplingParams(max_tokens=12)) for _ in range(10)]
    cancelled = set()
    for _ in range(200):
        if not ex._loop.step_here():  # a round as the executor's waits run it; False: nothing left
            break
        if ex._loop.in_flight is not None and ex._loop.in_flight.seqs and rng.random() < 0.3:
            victim = rng.choice(ex._loop.in_flight.seqs)  # its token is on the device, not yet read
            if not victim.finished:
                ex.cancel(victim.request_id)
                cancelled.add(victim.request_id)
    assert cancelled
    for rid in set(ids) - cancelled:
        answer = ex.await_response(rid, timeout=60)
        assert answer.finish_reason == "length" and len(answer.token_ids) == 12
    assert ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    assert ex._loop.in_flight is None
    ex.shutdown()
