"""Overlap scheduling (``SchedulerConfig.overlap``) on the CPU, against the same executor without
it (``helpers.overlap_workload``): the same tokens, finishes and logprobs for greedy, seeded and
penalised requests, ``n`` choices, stop ids, EOS, ``min_tokens`` and prefix hits, with requests
arriving while others decode; a request that stops wastes at most one step and emits nothing
past its stop; and after requests cancelled mid-flight, nothing is left in flight or in the pool."""

from __future__ import annotations

import random

import pytest
from helpers.overlap_workload import assert_same_outcome, frequent_tokens, run_workload
from helpers.tiny_llama import build_model, make_executor, reference

from bootstrap.engine import SamplingParams


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture(scope="module")
def frequent(model) -> list[int]:
    return frequent_tokens(model)


def outcome(model, frequent, overlap: bool, seed: int, prefix_caching: bool = True) -> tuple[list, int]:
    ex = make_executor(
        model,
        batch=6,
        num_tokens=40,
        kv_tokens=1024,
        eos_token_ids={frequent[0]},
        overlap=overlap,
        prefix_caching=prefix_caching,
    )
    return run_workload(ex, seed, frequent[1])


@pytest.mark.parametrize("seed", [1, 2])
def test_overlap_gives_the_tokens_finishes_and_logprobs_of_the_plain_loop(model, frequent, seed):
    plain, plain_forwards = outcome(model, frequent, False, seed)
    overlapped, overlapped_forwards = outcome(model, frequent, True, seed)
    assert_same_outcome(overlapped, plain)
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


def test_min_tokens_counts_the_token_in_flight(model):
    """``min_tokens=2`` with the stop id the model gives third: the third token stops the request,
    though the second is still in flight when the third is sampled."""
    prompt = next(p for p in ([3 + i, 50 + i, 90 + i] for i in range(50)) if len(set(reference(model, p, 3))) == 3)
    third = reference(model, prompt, 3)[2]
    for overlap in (False, True):
        ex = make_executor(model, overlap=overlap)
        [rid] = ex.enqueue_choices(prompt, SamplingParams(max_tokens=8, stop_token_ids=(third,), min_tokens=2))
        answer = ex.await_response(rid, timeout=60)
        ex.shutdown()
        assert (answer.token_ids, answer.finish_reason) == (reference(model, prompt, 3), "stop"), overlap


def test_engine_stats_say_whether_steps_overlap(model):
    for overlap in (False, True):
        ex = make_executor(model, overlap=overlap)
        assert ex.engine_stats().overlap is overlap
        ex.shutdown()
