"""Each request's ``RequestTiming`` on the real CPU engine: the points it passed (queued,
admitted, first token, finished) in order and in the steps that put it there, its prefill steps
under chunked prefill, the KV blocks it held, and the same record on its final stream event.
Orders and counts are asserted, never durations."""

from __future__ import annotations

import pytest
from helpers.tiny_llama import build_model, make_executor

from bootstrap.engine import SamplingParams

PROMPT = [(5 * i + 3) % 250 + 3 for i in range(50)]
TPB = 4


@pytest.fixture(scope="module")
def model():
    return build_model()


def test_a_chunked_prefill_counts_its_steps_and_the_points_come_in_order(model):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=16)  # 50 prompt tokens: 4 steps of prefill
    try:
        response = ex.await_response(ex.enqueue(PROMPT, SamplingParams(max_tokens=5, temperature=0)), timeout=60)
    finally:
        ex.shutdown()
    t = response.timing
    assert t.enqueued_ns <= t.scheduled_ns <= t.first_token_ns <= t.finished_ns
    assert t.prefill_steps == 4
    assert t.kv_blocks == -(-(50 + 5 - 1) // TPB)  # every token's KV but the last sampled one's: 14 blocks
    assert t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s > 0 and t.total_s >= t.prefill_s + t.decode_s


def test_a_request_waiting_for_a_batch_slot_is_admitted_after_the_first_finishes(model):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=64, batch=1)
    try:
        first = ex.enqueue(PROMPT, SamplingParams(max_tokens=4, temperature=0))
        second = ex.enqueue(PROMPT[:10], SamplingParams(max_tokens=2, temperature=0))
        a, b = ex.await_response(first, timeout=60), ex.await_response(second, timeout=60)
    finally:
        ex.shutdown()
    assert b.timing.enqueued_ns <= a.timing.scheduled_ns  # both queued before the first step
    assert b.timing.scheduled_ns >= a.timing.finished_ns  # one slot: the second waited for the first's end
    assert b.timing.queue_s >= a.timing.total_s - (b.timing.enqueued_ns - a.timing.enqueued_ns) / 1e9


def test_choices_share_their_parent_admission_and_prefill_and_hold_their_own_blocks(model):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=32, batch=8)  # two prefill steps
    try:
        ids = ex.enqueue_choices(PROMPT, SamplingParams(max_tokens=3, temperature=0), 3)
        responses = [ex.await_response(i, timeout=60) for i in ids]
    finally:
        ex.shutdown()
    timings = [r.timing for r in responses]
    assert len({t.scheduled_ns for t in timings}) == 1 and [t.prefill_steps for t in timings] == [2, 2, 2]
    assert len({t.first_token_ns for t in timings}) <= 3 and all(t.first_token_ns >= t.scheduled_ns for t in timings)
    # 52 KV tokens each: 13 blocks, 12 of them the prompt's full blocks, shared but counted by each holder
    assert [t.kv_blocks for t in timings] == [13, 13, 13]


def test_the_final_stream_event_carries_the_timing_and_a_refused_request_has_no_admission(model):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=64)
    try:
        events = list(ex.stream(ex.enqueue(PROMPT[:8], SamplingParams(max_tokens=3, temperature=0))))
        refused = ex.await_response(ex.enqueue([10**6]), timeout=60)
    finally:
        ex.shutdown()
    assert [e.timing is not None for e in events] == [False, False, True]
    assert events[-1].timing.prefill_steps == 1 and events[-1].timing.kv_blocks == 3  # 10 KV tokens
    assert refused.finish_reason == "error" and refused.timing.scheduled_ns is None and refused.timing.kv_blocks == 0
    assert refused.timing.prefill_s is None and refused.timing.decode_s is None


def test_a_cancel_that_keeps_the_response_leaves_how_far_it_got_to_be_taken(model):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=64, batch=1)
    try:
        running = ex.enqueue(PROMPT, SamplingParams(max_tokens=50, temperature=0))
        queued = ex.enqueue(PROMPT[:9], SamplingParams(max_tokens=5, temperature=0))
        stream = ex.stream(running)
        next(stream), next(stream)  # two steps: the first request runs, the second waits for its slot
        stream.close()
        ex.cancel(queued, keep_response=True)
        ex.cancel(running, keep_response=True)
        cut, never_ran = ex.await_response(running, timeout=60), ex.await_response(queued, timeout=60)
        with pytest.raises(TypeError, match="keep_response must be a bool"):
            ex.cancel(running, keep_response="yes")
        assert ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    finally:
        ex.shutdown()
    assert cut.finish_reason == "cancelled" and len(cut.token_ids) == 2 and cut.timing.first_token_ns is not None
    assert cut.timing.kv_blocks == -(-(50 + 1) // TPB)  # no worker: two steps ran, 51 tokens' KV held
    assert never_ran.finish_reason == "cancelled" and never_ran.timing.scheduled_ns is None
    with pytest.raises(KeyError):  # taken: released, as every response is once taken
        ex.await_response(running, timeout=1)
