"""The default model, SmolLM2-135M-Instruct, through the native engine on CPU.

Greedy output must equal transformers' ``generate()`` token for token on the same checkpoint.
The engine and the reference each load their own copy (the engine switches its model to paged
attention); both come from the cached conversion, so a session loads in about a second once
the first fetch (about 30 s) has filled the default cache.
"""

from __future__ import annotations

import pytest
import torch

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.models.decoder import DecoderLM
from bootstrap.engine.request.sequence import Sequence, next_request_id
from bootstrap.engine.sources import smollm2
from bootstrap.engine.sources.loader import LoadedWeights, load_model

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a GPU is.",
]


@pytest.fixture(scope="module")
def cache_dir(smollm2_cache):
    return smollm2_cache


@pytest.fixture(scope="module")
def reference(cache_dir) -> LoadedWeights:
    """transformers' own model of the same checkpoint (its eager attention), the reference."""
    return load_model(smollm2.NAME, device=CPU, cache_dir=cache_dir, attn_implementation="eager")


@pytest.fixture(scope="module")
def executor(cache_dir):
    loaded = load_model(smollm2.NAME, device=CPU, cache_dir=cache_dir)
    spec = KVCacheSpec.from_config(loaded.hf_config, loaded.model.dtype)
    cache = PagedKVCache.from_tokens(spec, 4096, 16, CPU)
    ex = create_executor(
        loaded.model, cache, SchedulerConfig(8, 512, 1024), loaded.tokenizer, set(loaded.eos_token_ids), start=False
    )
    yield ex
    ex.shutdown()


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def generate_reference(loaded: LoadedWeights, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=sorted(loaded.eos_token_ids),
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_generate_on_chat_prompts(executor, reference):
    prompts = [chat_ids(reference.tokenizer, q) for q in QUESTIONS]
    responses = executor.generate(prompts, SamplingParams(max_tokens=16))  # one batch of four
    for question, prompt, response in zip(QUESTIONS, prompts, responses):
        assert response.error is None
        assert response.token_ids == generate_reference(reference, prompt, 16), question


def test_the_engine_s_own_model_code_gives_transformers_logits(executor, reference):
    """The default model runs in the engine's own decoder; at the last prompt position its
    logits equal transformers' within 1e-4 (float32), for every chat prompt."""
    assert isinstance(executor.runner.model, DecoderLM) and not isinstance(reference.model, DecoderLM)
    for question in QUESTIONS:
        prompt = chat_ids(reference.tokenizer, question)
        executor.scheduler.add(Sequence(next_request_id(), prompt, SamplingParams(max_tokens=1)))
        own = executor.runner.run(executor.scheduler.schedule())[-1]
        executor.scheduler.drain()
        with torch.no_grad():
            expected = reference.model(torch.tensor([prompt])).logits[0, -1]
        assert (own - expected).abs().max().item() < 1e-4, question


def test_capital_of_france_is_paris(executor, reference):
    prompt = chat_ids(reference.tokenizer, "What is the capital of France?")
    [response] = executor.generate([prompt], SamplingParams(max_tokens=24))
    assert "Paris" in response.text
    assert response.finish_reason == "stop"  # ended by <|im_end|>, before max_tokens
    assert response.token_ids[-1] in reference.eos_token_ids
    assert "<|im_end|>" not in response.text


def test_seeded_sampling_is_reproducible(executor, reference):
    prompt = chat_ids(reference.tokenizer, "Tell me a short story about a cat.")
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=42)
    first, second = executor.generate([prompt, prompt], [params, params])
    assert first.token_ids == second.token_ids and first.error is None


def test_a_stop_string_cuts_the_text_where_it_starts(executor, reference):
    prompt = chat_ids(reference.tokenizer, "What is the capital of France?")
    [full] = executor.generate([prompt], SamplingParams(max_tokens=16))
    stop = " of"
    assert stop in full.text  # "The capital of France is Paris."
    [cut] = executor.generate([prompt], SamplingParams(max_tokens=16, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)


def test_bootstrap_run_answers_the_readme_question(cache_dir, capsys, tmp_path):
    """The README's first command: the default model through the stages names Paris (no CUDA graphs on the CPU)."""
    import json

    from bootstrap.cli.main import main

    argv = [
        "run",
        "--device",
        "cpu",
        "--chat",
        QUESTIONS[0],
        "--max-tokens",
        "16",
        "--max-num-tokens",
        "256",
        "--max-seq-len",
        "1024",
        "--plan-cache",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert "Paris" in result["text"]
    assert [s["outcome"] for s in result["stages"]] == [
        "skipped" if s["id"] == "warmup" else "ok" for s in result["stages"]
    ]
