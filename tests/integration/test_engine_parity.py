"""Greedy output of the native engine equals transformers' generate(), token for token.

Tiny random checkpoints of several architectures are built in the test (seeded, float32), so
nothing is downloaded. The engine runs its own copy of the weights with paged attention; the
reference runs transformers' stock attention with its own KV cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import BUILDERS, build

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor


def reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, attention_mask=None)
    return out[0, len(prompt) :].tolist()


def engine(model, *, tokens_per_block=4, max_batch_size=8, max_num_tokens=64, max_seq_len=128, kv_tokens=2048):
    spec = KVCacheSpec.from_config(model.config, torch.float32)
    cache = PagedKVCache.from_tokens(spec, kv_tokens, tokens_per_block, "cpu")
    config = SchedulerConfig(max_batch_size, max_num_tokens, max_seq_len)
    return create_executor(copy.deepcopy(model), cache, config, start=False)


def prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_ragged_batch_matches_generate(name):
    """Prompts longer than a block, of different lengths, in one batch."""
    model = build(name)
    batch = prompts(5, 1, 23, seed=7)
    ex = engine(model)
    responses = ex.generate(batch, SamplingParams(max_tokens=10))
    for prompt, response in zip(batch, responses):
        assert response.error is None
        assert response.token_ids == reference(model, prompt, 10), f"prompt of {len(prompt)} tokens"
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_chunked_prefill_matches_generate(name):
    """A 50-token prompt through steps of at most 16 tokens: four prefill chunks."""
    model = build(name)
    prompt = prompts(1, 50, 50, seed=3)[0]
    ex = engine(model, max_batch_size=4, max_num_tokens=16)
    [response] = ex.generate([prompt], SamplingParams(max_tokens=8))
    assert response.token_ids == reference(model, prompt, 8)
    ex.shutdown()


def test_chunked_prefill_mixed_with_decodes():
    """Long prompts chunked while short requests decode in the same steps."""
    model = build("mistral")
    batch = [*prompts(3, 2, 5, seed=11), *prompts(2, 30, 40, seed=12)]
    ex = engine(model, max_batch_size=5, max_num_tokens=12, tokens_per_block=8)
    responses = ex.generate(batch, SamplingParams(max_tokens=12))
    for prompt, response in zip(batch, responses):
        assert response.token_ids == reference(model, prompt, 12)
    ex.shutdown()


def test_32_requests_at_once_with_worker():
    model = build("llama")
    batch = prompts(32, 1, 30, seed=5)
    ex = engine(model, max_batch_size=32, max_num_tokens=128, tokens_per_block=8)
    ex.start_worker()
    ids = [ex.enqueue(p, SamplingParams(max_tokens=6)) for p in batch]
    responses = [ex.await_response(i, timeout=120) for i in ids]
    for prompt, response in zip(batch, responses):
        assert response.finish_reason in ("stop", "length") and response.error is None
        assert response.token_ids == reference(model, prompt, 6)
    stats = ex.scheduler.kv_cache.stats()
    assert (stats.used_blocks, stats.used_bytes, stats.free_blocks) == (0, 0, stats.total_blocks)
    ex.shutdown()


def test_bfloat16_model_runs_and_matches_its_own_prefill():
    """bfloat16 on the CPU: the engine's first token equals the model's own argmax."""
    model = build("llama").to(torch.bfloat16)
    batch = prompts(3, 5, 20, seed=9)
    spec = KVCacheSpec.from_config(model.config, torch.bfloat16)
    cache = PagedKVCache.from_tokens(spec, 512, 4, "cpu")
    ex = create_executor(copy.deepcopy(model), cache, SchedulerConfig(4, 64, 64), start=False)
    responses = ex.generate(batch, SamplingParams(max_tokens=1))
    with torch.no_grad():
        for prompt, response in zip(batch, responses):
            assert response.token_ids == [int(model(torch.tensor([prompt])).logits[0, -1].argmax())]
    ex.shutdown()
