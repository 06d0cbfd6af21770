"""Prefix caching on the real CPU engine: a request whose prompt starts with blocks computed
before starts after them (``cached_tokens``), and answers what it answers without the cache on
every tiny family (windows, soft-caps, QK norms), with chunked prefill, ``n`` choices and a
draft model; salts share nothing; a pool that holds one prefix at a time evicts and still
answers right; and after random cancels over shared prefixes every block, reservation and
holder is accounted for."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from helpers.tiny_models import BUILDERS, build

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.request.prefix_hash import extend_hashes

TPB = 4
PREFIX = [(11 * i + 5) % 240 + 3 for i in range(26)]  # 6 full blocks and 2 tokens
TAILS = [[17, 29, 31], [101, 7], [44, 45, 46, 47, 48, 49, 50]]
BOUND_S = 120.0  # a deadlock guard only


def engine(model, *, caching=True, kv_tokens=2048, num_tokens=64, batch=8, draft=None, start=False):
    def pool(m):
        return PagedKVCache.from_tokens(KVCacheSpec.from_config(m.config, torch.float32), kv_tokens, TPB, "cpu")

    drafted = None if draft is None else (copy.deepcopy(draft), pool(draft))
    config = SchedulerConfig(batch, num_tokens, 128, prefix_caching=caching)
    return create_executor(copy.deepcopy(model), pool(model), config, start=start, draft=drafted)


def one_by_one(ex, prompts, params=None, salts=None):
    """Each prompt answered before the next is queued (so each finds the blocks of those before)."""
    params = params or SamplingParams(max_tokens=6)
    out = []
    for i, prompt in enumerate(prompts):
        rid = ex.enqueue(prompt, params, cache_salt=salts[i] if salts else None)
        out.append(ex.await_response(rid, BOUND_S))
    return out


def assert_all_free(ex):
    kv = ex.scheduler.kv_cache
    stats = kv.stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks
    assert stats.cached_free_blocks == stats.cached_blocks and kv.shared_blocks() == 0
    assert ex.scheduler.capacity.reserved_blocks == 0 and not ex.scheduler.running and not ex.scheduler.waiting


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_cached_prefix_answers_as_without_the_cache_on_every_family(name):
    model = build(name)
    prompts = [PREFIX + tail for tail in TAILS] + [PREFIX[:24]]  # the last: 6 full blocks, all cached
    cached, plain = engine(model), engine(model, caching=False)
    try:
        with_cache, without = one_by_one(cached, prompts), one_by_one(plain, prompts)
        assert [r.token_ids for r in with_cache] == [r.token_ids for r in without]
        # the first computes it all; the others start after 6 full blocks (24 tokens), the last
        # after 5: its last prompt token is computed again for its logits
        assert [r.cached_tokens for r in with_cache] == [0, 24, 24, 20]
        assert all(r.cached_tokens == 0 for r in without)
        stats = cached.engine_stats()
        assert stats.prefix_caching and stats.prefix_hit_tokens == 68
        assert stats.prefix_query_tokens == sum(len(p) for p in prompts)
        assert_all_free(cached)
    finally:
        cached.shutdown()
        plain.shutdown()


def test_generated_tokens_are_cached_too_so_a_next_turn_reuses_the_answer():
    model = build("llama")
    ex = engine(model)
    try:
        [first] = one_by_one(ex, [PREFIX], SamplingParams(max_tokens=12))
        turn = PREFIX + list(first.token_ids) + [9, 9, 9]
        [second] = one_by_one(ex, [turn])
        assert second.cached_tokens == (len(PREFIX) + 12 - 1) // TPB * TPB  # the answer's full blocks included
        [plain] = one_by_one(engine(model, caching=False), [turn])
        assert second.token_ids == plain.token_ids
    finally:
        ex.shutdown()


def test_chunked_prefill_choices_and_salts():
    model = build("qwen2")
    long_prefix = [(13 * i + 1) % 240 + 3 for i in range(70)]
    ex, plain = engine(model, num_tokens=16), engine(model, num_tokens=16, caching=False)  # prefill in chunks
    try:
        params = SamplingParams(max_tokens=5)
        one_by_one(ex, [[*long_prefix, 1]])
        ids = ex.enqueue_choices([*long_prefix, 2, 3], params, 3)
        choices = [ex.await_response(i, BOUND_S) for i in ids]
        want = one_by_one(plain, [[*long_prefix, 2, 3]], params)[0].token_ids
        assert [c.token_ids for c in choices] == [want] * 3 and choices[0].cached_tokens == 68

        [other] = one_by_one(ex, [[*long_prefix, 2, 3]], params, salts=["tenant-b"])  # another tenant: nothing shared
        [mine] = one_by_one(ex, [[*long_prefix, 4]], salts=["tenant-b"])  # its own prefix, now cached
        assert other.cached_tokens == 0 and mine.cached_tokens == 68 and other.token_ids == want
        assert_all_free(ex)
    finally:
        ex.shutdown()
        plain.shutdown()


def test_a_pool_that_holds_one_prefix_evicts_the_older_and_answers_right():
    model = build("llama")
    other = [(3 * i + 7) % 240 + 3 for i in range(26)]
    prompts = [[*PREFIX, 1], [*PREFIX, 2], [*other, 1], [*PREFIX, 3], [*other, 2]]
    ex = engine(model, kv_tokens=36)  # 9 blocks: one 27-token prompt and its answer, not two prefixes
    plain = engine(model, kv_tokens=36, caching=False)
    try:
        got, want = one_by_one(ex, prompts), one_by_one(plain, prompts)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.cached_tokens for r in got] == [0, 24, 0, 0, 0]  # each prefix evicted by the other
        assert_all_free(ex)
    finally:
        ex.shutdown()
        plain.shutdown()


def test_a_draft_model_keeps_its_pool_cached_too_and_answers_as_without_the_cache():
    target, draft = build("llama"), build("llama")
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prompts = [PREFIX + tail for tail in TAILS]
    ex, plain = engine(target, draft=draft), engine(target, draft=draft, caching=False)
    try:
        got, want = one_by_one(ex, prompts), one_by_one(plain, prompts)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.cached_tokens for r in got] == [0, 24, 24]
        draft_pool = ex.speculator.pool.stats()
        assert draft_pool.cached_blocks > 0 and draft_pool.used_blocks == 0
        assert_all_free(ex)
    finally:
        ex.shutdown()
        plain.shutdown()


def test_a_draft_pool_holding_a_shorter_cached_run_than_the_target_s_starts_both_after_the_shorter():
    """The draft is the target itself (every proposal kept when its keys and values are right),
    in a pool of 12 blocks: a second prompt evicts the first's prefix from it (the target's pool
    keeps it), a third caches the prefix's first 2 blocks again. A prompt on the prefix then
    finds 6 blocks in the target's pool and 2 in the draft's: it starts after 2 in both, and the
    draft, having computed the rest itself, still proposes what the target answers."""
    model = build("llama")

    def pool(tokens: int) -> PagedKVCache:
        return PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.float32), tokens, TPB, "cpu")

    config = SchedulerConfig(8, 64, 128, prefix_caching=True)
    ex = create_executor(copy.deepcopy(model), pool(2048), config, start=False, draft=(copy.deepcopy(model), pool(48)))
    plain = engine(model, caching=False)
    other = [(3 * i + 7) % 240 + 3 for i in range(26)]
    try:
        one_by_one(ex, [[*PREFIX, 1], [*other, 1], [*PREFIX[:9], 5, 5, 5]])
        prompt, params = [*PREFIX, 2], SamplingParams(max_tokens=12)
        usable = extend_hashes([], prompt, TPB, None)[:6]
        assert (len(ex.scheduler.kv_cache.match(usable)), len(ex.speculator.pool.match(usable))) == (6, 2)
        proposed, accepted = ex.speculator.stats.proposed, ex.speculator.stats.accepted
        [got], [want] = one_by_one(ex, [prompt], params), one_by_one(plain, [prompt], params)
        kept = (ex.speculator.stats.proposed - proposed, ex.speculator.stats.accepted - accepted)
        assert kept[0] > 0 and kept[1] == kept[0]  # the draft's keys and values of the prefix are its own
        assert got.cached_tokens == 2 * TPB and got.token_ids == want.token_ids
        assert_all_free(ex)
    finally:
        ex.shutdown()
        plain.shutdown()


def test_random_cancels_over_shared_prefixes_leave_every_block_accounted_for():
    """Sixty requests over three shared prefixes from four threads, a third of them cancelled at
    random points, on a running worker: the others answer as without the cache, and nothing is
    held after."""
    model = build("llama")
    prefixes = [[(k * 7 + i * 5) % 240 + 3 for i in range(18 + 6 * k)] for k in range(3)]
    rng = random.Random(5)
    tails = [[rng.randrange(3, 240) for _ in range(rng.randrange(1, 9))] for _ in range(60)]
    jobs = [prefixes[rng.randrange(3)] + tail for tail in tails]
    plain = engine(model, caching=False)
    want = {tuple(p): r.token_ids for p, r in zip(jobs, one_by_one(plain, jobs))}
    plain.shutdown()
    ex = engine(model, kv_tokens=256, batch=6, start=True)  # a pool that must evict under this load
    answers, errors = {}, []

    def client(k: int) -> None:
        local = random.Random(k)
        try:
            for prompt in jobs[k::4]:
                rid = ex.enqueue(prompt, SamplingParams(max_tokens=6))
                if local.random() < 0.33:
                    for _ in range(local.randrange(3)):
                        threading.Event().wait(local.random() / 500)  # a random point of its life
                    ex.cancel(rid, keep_response=True)
                answers[rid] = (prompt, ex.await_response(rid, BOUND_S))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        assert not errors and len(answers) == 60
        done = [(p, r) for p, r in answers.values() if r.finish_reason != "cancelled"]
        assert done and all(r.token_ids == want[tuple(p)] for p, r in done)
        assert any(r.cached_tokens for _, r in done)
        ex.shutdown()  # the worker stopped: the pool as the last step left it
        assert_all_free(ex)
        assert ex.scheduler.kv_cache._refs == {}
    finally:
        ex.shutdown()
