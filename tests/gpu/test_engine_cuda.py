"""The native engine on a CUDA device: greedy parity with generate() and the half-precision paths."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    eos_token_id=None,
    bos_token_id=None,
)


def build(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(4321)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=6, max_window_layers=1))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0) if param.dim() > 1 else None
    return model.eval().to("cuda", dtype)


def executor(model, dtype, max_num_tokens=64):
    spec = KVCacheSpec.from_config(model.config, dtype)
    cache = PagedKVCache.from_tokens(spec, 4096, 16, "cuda")
    return create_executor(copy.deepcopy(model), cache, SchedulerConfig(32, max_num_tokens, 256), start=True)


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(8)
    return [
        torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(1, 60, (count,), generator=gen)
    ]


def reference(model, prompt, max_tokens):
    out = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_greedy_parity_with_generate(kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(kind, torch.float32)
    batch = prompts(32)
    ex = executor(model, torch.float32, max_num_tokens=48)  # long prompts are chunked
    responses = ex.generate(batch, SamplingParams(max_tokens=12))
    mismatched = [i for i, (p, r) in enumerate(zip(batch, responses)) if r.token_ids != reference(model, p, 12)]
    assert not mismatched
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()
    assert ex.runner.kv_cache.released


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_first_token_matches_the_model(dtype):
    model = build("llama", dtype)
    batch = prompts(8)
    ex = executor(model, dtype)
    responses = ex.generate(batch, SamplingParams(max_tokens=4))
    with torch.no_grad():
        for prompt, response in zip(batch, responses):
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1]
            assert response.ok and len(response.token_ids) == 4
            assert logits[response.token_ids[0]] >= logits.max() - 0.05 * logits.abs().max()
    ex.shutdown()
