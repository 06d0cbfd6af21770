"""Issue 21 on a CUDA device: ``n`` choices share their prompt's KV blocks (the partial last block
copied on the device) and each equals what an independent request gives; logprobs are the model's
own log-softmax."""

from __future__ import annotations

import pytest
import torch
from test_engine_cuda import build, executor, reference

from bootstrap.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("length", [50, 64])  # a partial last block of 16 tokens, and none
def test_choices_on_cuda_equal_independent_requests(length):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(length)]
    ex = executor(model, torch.float32)
    try:
        greedy = [
            ex.await_response(i, timeout=120).token_ids
            for i in ex.enqueue_choices(prompt, SamplingParams(max_tokens=12, temperature=0), 4)
        ]
        seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=77)
        together = [ex.await_response(i, timeout=120).token_ids for i in ex.enqueue_choices(prompt, seeded, 4)]
        apart = [
            ex.await_response(
                ex.enqueue(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=77 + i)), timeout=120
            ).token_ids
            for i in range(4)
        ]
        assert ex.scheduler.kv_cache.stats().used_blocks == 0 and ex.scheduler.kv_cache.shared_blocks() == 0
    finally:
        ex.shutdown()
    assert greedy == [reference(model, prompt, 12)] * 4
    assert together == apart


def test_logprobs_on_cuda_are_the_models_log_softmax():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    prompt = [(11 * i + 5) % 250 + 3 for i in range(20)]
    ex = executor(model, torch.float32)
    try:
        [response] = [
            ex.await_response(i, timeout=120)
            for i in ex.enqueue_choices(prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=5), 1)
        ]
    finally:
        ex.shutdown()
    for step, entry in enumerate(response.logprobs):
        with torch.no_grad():
            ids = torch.tensor([prompt + response.token_ids[:step]], device="cuda")
            want = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
        values, top = want.topk(5)
        assert entry.token_id == int(top[0]) and abs(entry.logprob - float(want[entry.token_id])) < 1e-4
        assert [t for t, _ in entry.top] == top.tolist()
        assert max(abs(v - float(w)) for (_, v), w in zip(entry.top, values)) < 1e-4
