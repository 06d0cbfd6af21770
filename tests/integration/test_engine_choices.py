"""``n`` choices of one prompt on the real CPU engine (``PyExecutor.enqueue_choices``): the prompt
is prefilled once, its full KV blocks shared and its partial last block copied per choice, and
each choice is what an independent request would give (greedy: transformers' own output; seeded:
the request with ``seed + i``). Cancelling any choice at any point, the first one mid-prefill
included, leaves the others whole and no block, handle or request behind."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from helpers.tiny_llama import build_model, make_executor, reference

from bootstrap.engine import SamplingParams

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(50)]  # 12 full blocks of 4 tokens and 2 tokens more
TPB = 4


@pytest.fixture(scope="module")
def model():
    return build_model()


def step(ex) -> None:
    """One round of the loop in this thread (its inbox taken in, cancels applied, one step), as
    a caller waiting on an executor without a worker drives it."""
    ex._loop.step_here()


def run_all(ex, ids):
    return [ex.await_response(i, timeout=60) for i in ids]


def test_greedy_choices_prefill_once_share_the_prompt_blocks_and_equal_transformers(model):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=64, batch=8)
    try:
        ids = ex.enqueue_choices(PROMPT, SamplingParams(max_tokens=6, temperature=0), 4)
        step(ex)  # the whole prompt in one step (64 tokens a step); then the fork
        kv = ex.runner.kv_cache
        # the first choice's 13 blocks, plus one copied partial block per other choice: 16, not 52
        assert kv.stats().used_blocks == 13 + 3 and kv.shared_blocks() == 12
        assert kv.stats().used_tokens == 50 + 3 * 2  # the shared 48 tokens once, each choice's 2 in its copy
        # reserved for their whole lives (55 KV tokens each): 14 blocks, and 14 - 12 shared for each other choice
        assert ex.scheduler.capacity.reserved_blocks == 14 + 3 * 2
        responses = run_all(ex, ids)
    finally:
        ex.shutdown()
    want = reference(model, PROMPT, 6)
    assert [r.token_ids for r in responses] == [want] * 4 and all(r.finish_reason == "length" for r in responses)


def test_seeded_choices_are_the_requests_seeded_seed_plus_i(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=41)
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=32)  # the prompt over two steps: chunked prefill
    try:
        together = [r.token_ids for r in run_all(ex, ex.enqueue_choices(PROMPT, params, 4))]
        again = [r.token_ids for r in run_all(ex, ex.enqueue_choices(PROMPT, params, 4))]
        alone = [
            ex.await_response(
                ex.enqueue(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=41 + i)), timeout=60
            ).token_ids
            for i in range(4)
        ]
        assert ex.runner.kv_cache.stats().used_blocks == 0
    finally:
        ex.shutdown()
    assert together == again == alone and len(set(map(tuple, together))) == 4


@pytest.mark.parametrize("which", [0, 2])
def test_a_choice_cancelled_mid_prefill_leaves_the_others_whole(model, which):
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=16)  # the prompt over four steps
    try:
        ids = ex.enqueue_choices(PROMPT, SamplingParams(max_tokens=6, temperature=0), 3)
        step(ex)
        ex.cancel(ids[which])  # choice 0 carries the others: choice 1 takes its place and prefills again
        responses = [ex.await_response(i, timeout=60) for i in ids if i != ids[which]]
        assert ex.runner.kv_cache.stats().used_blocks == 0 and ex.stats().handles == 0
    finally:
        ex.shutdown()
    assert [r.token_ids for r in responses] == [reference(model, PROMPT, 6)] * 2


def test_impossible_choices_are_all_refused_and_n_is_checked(model):
    ex = make_executor(model, tokens_per_block=TPB, batch=4)
    try:
        ids = ex.enqueue_choices(PROMPT, SamplingParams(max_tokens=4), 5)
        responses = run_all(ex, ids)
        assert {r.error for r in responses} == {
            "request rejected: n=5 choices cannot run at once with max_batch_size 4"
        }
        for bad in (0, 17, True, 2.0):
            with pytest.raises(ValueError, match=r"n must be an integer in \[1, 16\]"):
                ex.enqueue_choices(PROMPT, SamplingParams(max_tokens=4), bad)
    finally:
        ex.shutdown()


def test_choices_cancelled_at_random_steps_are_all_accounted_for(model):
    """Seeded: 6 rounds of 3 prompts x 4 choices, each choice cancelled at a random step or never."""
    rng = random.Random(2112)
    want = {n: reference(model, PROMPT[:n], 8) for n in (5, 23, 50)}
    ex = make_executor(model, tokens_per_block=TPB, num_tokens=24, batch=16, kv_tokens=4096)
    try:
        for _ in range(6):
            groups = {n: ex.enqueue_choices(PROMPT[:n], SamplingParams(max_tokens=8, temperature=0), 4) for n in want}
            cancel_at = {i: rng.choice([None, 0, 1, 2, 3, 5]) for ids in groups.values() for i in ids}
            for at_step in range(12):
                for i, at in cancel_at.items():
                    if at == at_step:
                        ex.cancel(i)
                step(ex)
            for n, ids in groups.items():
                for i in ids:
                    if cancel_at[i] is None:
                        response = ex.await_response(i, timeout=60)
                        assert response.token_ids == want[n] and response.finish_reason == "length"
            assert ex.runner.kv_cache.stats().used_blocks == 0 and ex.runner.kv_cache.shared_blocks() == 0
            assert ex.stats().handles == 0 and not ex.scheduler.has_work
    finally:
        ex.shutdown()


def test_the_choices_benchmark_counts_the_prompt_once(tmp_path):
    """``benchmarks/choices_kv.py`` end to end, small: one prefill and the prompt's blocks once."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "choices_kv.py"
    spec = importlib.util.spec_from_file_location("choices_kv", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "choices.json"
    assert module.main(["--prompt-len", "40", "--max-tokens", "4", "--n", "3", "--tpb", "8", "--out", str(out)]) == 0
    together, apart = json.loads(out.read_text())["runs"]
    assert together["same_outputs_as_separate"] and (together["prefill_tokens"], apart["prefill_tokens"]) == (40, 120)
    assert (together["blocks_after_prefill"], apart["blocks_after_prefill"]) == (
        5,
        15,
    )  # 40 tokens: 5 full blocks, shared
