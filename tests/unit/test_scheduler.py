"""Capacity (guaranteed-no-evict) and micro-batch scheduling, without a model.

Steps are simulated the way the executor applies them: the scheduled tokens become computed,
and a request that completes its pending tokens gets one new token.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.request.sequence import Sequence, SequenceStatus
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.engine.scheduler import Scheduler, SchedulerConfig

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def make(num_blocks=16, tpb=4, batch=4, tokens=16, seq_len=64) -> Scheduler:
    cache = PagedKVCache(SPEC, num_blocks, tpb, "cpu")
    return Scheduler(cache, SchedulerConfig(batch, tokens, seq_len))


_ids = iter(range(10**9))


def seq(prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(next(_ids), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def apply(scheduler: Scheduler, batch) -> list[Sequence]:
    """Advance every scheduled request as a real step would; return those that finished."""
    done = []
    for s, count, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples()):
        s.num_computed += count
        if samples:
            s.append(0)
            if len(s.output_token_ids) == s.params.max_tokens:
                s.finish("length")
                scheduler.finish(s)
                done.append(s)
    return done


def test_config_validation_names_fields():
    with pytest.raises(ValueError, match="max_num_tokens"):
        SchedulerConfig(max_batch_size=1, max_num_tokens=0)
    with pytest.raises(ValueError, match=r"max_batch_size .* must be <= max_num_tokens"):
        SchedulerConfig(max_batch_size=8, max_num_tokens=4)


def test_rejections_say_why():
    scheduler = make(num_blocks=4, tpb=4, seq_len=64)
    assert "empty" in scheduler.add(seq(0, 4))
    assert "exceeds max_seq_len (64)" in scheduler.add(seq(60, 5))
    assert "needs 5 KV blocks" in scheduler.add(seq(10, 11))  # 20 KV tokens, pool of 16
    assert scheduler.add(seq(10, 7)) is None  # 16 KV tokens: exactly the pool
    assert len(scheduler.waiting) == 1


def test_admission_reserves_the_whole_life_and_never_evicts():
    scheduler = make(num_blocks=10, tpb=4, batch=4, tokens=64)
    a, b, c = seq(10, 3), seq(10, 11), seq(7, 6)  # 3, 5 and 3 blocks over their lives
    for s in (a, b, c):
        scheduler.add(s)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b] and c.status is SequenceStatus.WAITING
    assert scheduler.capacity.reserved_blocks == 8
    assert scheduler.kv_cache.stats().used_blocks == 6  # only what the prompts hold so far
    apply(scheduler, batch)
    while a.status is not SequenceStatus.FINISHED:
        step = scheduler.schedule()
        assert c not in step.seqs
        apply(scheduler, step)
    assert scheduler.kv_cache.num_tokens(b.request_id) == 12
    step = scheduler.schedule()
    assert step.seqs == [b, c] and scheduler.capacity.reserved_blocks == 8


def test_head_of_line_is_not_overtaken():
    scheduler = make(num_blocks=8, tpb=4, batch=4, tokens=64)
    big, small = seq(20, 9), seq(2, 2)  # 7 blocks, then 1
    scheduler.add(seq(8, 1))  # 2 blocks: leaves 6, too few for big
    scheduler.add(big)
    scheduler.add(small)
    batch = scheduler.schedule()
    assert big not in batch.seqs and small not in batch.seqs


def test_decodes_first_then_prefill_chunks_within_budget():
    scheduler = make(num_blocks=64, tpb=4, batch=4, tokens=10)
    short, long_ = seq(3, 5), seq(25, 2)
    scheduler.add(short)
    scheduler.add(long_)
    first = scheduler.schedule()
    assert first.num_new_tokens == [3, 7] and first.samples() == [True, False]
    apply(scheduler, first)
    second = scheduler.schedule()
    assert second.seqs == [short, long_] and second.num_new_tokens == [1, 9]
    assert scheduler.kv_cache.num_tokens(long_.request_id) == 16
    apply(scheduler, second)
    third = scheduler.schedule()
    assert third.num_new_tokens == [1, 9] and third.samples() == [True, True]


def test_batch_size_limits_running_requests():
    scheduler = make(num_blocks=64, tpb=4, batch=2, tokens=64)
    seqs = [seq(2, 2) for _ in range(3)]
    for s in seqs:
        scheduler.add(s)
    assert scheduler.schedule().seqs == seqs[:2]
    assert scheduler.running == seqs[:2] and list(scheduler.waiting) == seqs[2:]


def test_drain_frees_everything():
    scheduler = make()
    for _ in range(3):
        scheduler.add(seq(5, 3))
    scheduler.schedule()
    assert len(scheduler.drain()) == 3
    assert scheduler.kv_cache.stats().used_blocks == 0 and scheduler.capacity.reserved_blocks == 0


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    tpb=st.sampled_from([1, 2, 4, 8]),
    batch=st.integers(1, 6),
    extra_tokens=st.integers(0, 20),
)
def test_any_workload_completes_within_limits(requests, tpb, batch, extra_tokens):
    """Every request finishes, no step breaks a limit, the pool never overflows and ends empty."""
    tokens = batch + extra_tokens
    scheduler = make(num_blocks=max(1, 60 // tpb), tpb=tpb, batch=batch, tokens=tokens, seq_len=64)
    accepted = [s for s in (seq(p, m) for p, m in requests) if scheduler.add(s) is None]
    finished = []
    for _ in range(10_000):
        if not scheduler.has_work:
            break
        step = scheduler.schedule()
        assert step.seqs, "a step with work queued must schedule something"
        assert step.total_tokens <= tokens and len(step.seqs) <= batch
        assert scheduler.kv_cache.stats().used_blocks <= scheduler.kv_cache.num_blocks
        finished += apply(scheduler, step)
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in accepted)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in finished)
    assert scheduler.kv_cache.stats().used_blocks == 0
