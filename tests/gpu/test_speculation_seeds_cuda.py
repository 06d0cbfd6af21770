"""Seeded sampling on a CUDA device (float32, TF32 off): a seeded request gives the same tokens
alone and among 31 others (long prompts chunked, the worker thread running), without a draft,
with a draft that always agrees and with one that mostly does not: each seeded token is the
sampler's race with its position's noise, which the draft proposes with and the target judges
with (``spec.verify.accept_matching``)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine_cuda import build, prompts
from test_speculation_cuda import drafted

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def plain(model):
    pool = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.float32), 8192, 16, "cuda")
    return create_executor(copy.deepcopy(model), pool, SchedulerConfig(32, 48, 256), start=True)


def test_a_seeded_request_on_cuda_gives_the_same_tokens_alone_in_a_crowd_and_with_a_draft():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # a draft that mostly disagrees
    batch = prompts(32)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    crowd = [SamplingParams(max_tokens=16, temperature=0.8 if i % 2 else 0) for i in range(31)]
    got = {}
    for name, make in (
        ("plain", lambda: plain(model)),
        ("agrees", lambda: drafted(model, model)),
        ("other", lambda: drafted(model, other)),
    ):
        ex = make()
        try:
            got[name, "alone"] = ex.generate([batch[0]], seeded)[0].token_ids
            got[name, "crowd"] = ex.generate(batch, [seeded, *crowd])[0].token_ids
            assert name == "plain" or ex.speculator.stats.proposed > 0
        finally:
            ex.shutdown()
    want = got["plain", "alone"]
    assert len(want) == 16 and all(tokens == want for tokens in got.values()), got
