"""Logprobs from the real CPU engine against a transformers model's own distribution."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.sources.loader import load_model
from tests.helpers.tiny_models import save_checkpoint

CPU = torch.device("cpu")
PROMPTS = [[1, 17, 40, 99, 7], [1, 200, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("llama", tmp_path_factory.mktemp("logprobs") / "llama")


def _executor(path):
    loaded = load_model(str(path), device=CPU, dtype=torch.float32)
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(loaded.model.config, torch.float32), 512, 4, "cpu")
    return create_executor(
        loaded.model, cache, SchedulerConfig(4, 64, 128), loaded.tokenizer, loaded.eos_token_ids, start=False
    )


def _reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the transformers model's logits after ``ids`` (the whole prefix, no cache)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def test_greedy_logprobs_match_the_transformers_model(checkpoint):
    params = SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True)
    ex = _executor(checkpoint)
    try:
        ids = [ex.enqueue(p, params) for p in PROMPTS]
        streamed = [list(ex.stream(ids[0]))]
        responses = [ex.await_response(i, timeout=60) for i in ids[1:]]
    finally:
        ex.shutdown()
    events = streamed[0]
    assert [e.token_id for e in events] and all(e.logprob is not None and len(e.top_logprobs) == 5 for e in events)
    checked = [(PROMPTS[0], [e.token_id for e in events], [(e.token_id, e.logprob, e.top_logprobs) for e in events])]
    for prompt, response in zip(PROMPTS[1:], responses):
        assert response.logprobs is not None and len(response.logprobs) == len(response.token_ids) == 6
        checked.append((prompt, response.token_ids, [(e.token_id, e.logprob, e.top) for e in response.logprobs]))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    for prompt, tokens, entries in checked:
        for step, (token, logprob, top) in enumerate(entries):
            want = _reference(model, prompt + tokens[:step])
            top_values, top_ids = want.topk(5)
            assert token == tokens[step] == int(top_ids[0])  # greedy: the chosen token is the top-1
            assert logprob == pytest.approx(float(want[token]), abs=1e-4)
            assert [t for t, _ in top] == top_ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), top_values, atol=1e-4, rtol=0)


def test_a_sampled_token_that_is_not_the_argmax_has_its_own_logprob(checkpoint):
    params = SamplingParams(max_tokens=8, temperature=3.0, seed=11, logprobs=2, ignore_eos=True)
    ex = _executor(checkpoint)
    try:
        response = ex.await_response(ex.enqueue(PROMPTS[0], params), timeout=60)
    finally:
        ex.shutdown()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    below_top = 0
    for step, entry in enumerate(response.logprobs):
        want = _reference(model, PROMPTS[0] + response.token_ids[:step])
        assert entry.token_id == response.token_ids[step]
        assert entry.logprob == pytest.approx(float(want[entry.token_id]), abs=1e-4)  # the raw distribution's
        assert entry.top[0][0] == int(want.argmax())
        below_top += entry.token_id != int(want.argmax())
    assert below_top > 0  # some steps sampled a token other than the most likely


def test_requests_without_logprobs_carry_none(checkpoint):
    ex = _executor(checkpoint)
    try:
        rid = ex.enqueue(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
        events = list(ex.stream(rid))
    finally:
        ex.shutdown()
    assert len(events) == 3 and all(e.logprob is None and e.top_logprobs == () for e in events)
