"""Speculative decoding on a CUDA device (float32, TF32 off): greedy output with a draft is the
target's own (transformers' ``generate``) on llama and windowed qwen2, for a draft that agrees
and one that does not, with the worker thread running and 32 requests at once; both pools empty
afterwards."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine_cuda import build, prompts, reference

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def drafted(model, draft):
    def pool(m):
        return PagedKVCache.from_tokens(KVCacheSpec.from_config(m.config, torch.float32), 8192, 16, "cuda")

    return create_executor(copy.deepcopy(model), pool(model), SchedulerConfig(32, 48, 256), start=True,
                           draft=(copy.deepcopy(draft), pool(draft)), speculative_tokens=4)  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_with_a_draft_on_cuda_is_the_targets_own(kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(kind, torch.float32)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # a draft that mostly disagrees
    batch = prompts(32)
    want = [reference(model, p, 16) for p in batch]
    for draft in (model, other):
        ex = drafted(model, draft)
        try:
            got = [r.token_ids for r in ex.generate(batch, SamplingParams(max_tokens=16))]
            stats = ex.speculator.stats
            pools = (ex.scheduler.kv_cache, ex.speculator.pool)
            assert all(p.stats().used_blocks == 0 for p in pools)
        finally:
            ex.shutdown()
        assert got == want and stats.steps > 0
        assert (stats.acceptance_rate == 1.0) == (draft is model)
