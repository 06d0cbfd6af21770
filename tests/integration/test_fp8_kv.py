"""An e4m3 KV cache (``kv_cache_dtype: fp8``) on the CPU engine, for each tiny family: the pool
holds a quarter of float32's bytes a token, the plan and ``/v1/engine``'s stats say fp8 and
where its scales came from, a prompt's first token equals the float32 pool's, and a
checkpoint's per-layer ``k_scale``/``v_scale`` of 0.5 (a power of two: e4m3 rounds ``x / 0.5``
as it rounds ``x``) answers every token as scales of 1.0 do, where forgetting a scale anywhere
would change them. A checkpoint with scales for some layers only is refused; new weights bring
their own. With a draft of the target's weights every proposal is accepted (its own fp8 pool
with its scales); a cached prefix answers as the whole prompt in one chunk (every read, a fresh
chunk's of its own keys too, is rounded). Across ranks: tests/integration/test_tensor_parallel.py.
The attention's own arithmetic: tests/integration/test_engine_attention.py."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from helpers.fp8_checkpoints import with_kv_scales
from helpers.tiny_models import save_checkpoint

from bootstrap.api import Bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.pipeline.runner import StageFailed

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]
PROMPTS = [[1, 7, 9, 4, 11, 3, 200, 13, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42], [5, 9, 2, 77]]


async def answer(path: Path, prompts=PROMPTS, **config) -> tuple[list[list[int]], dict, object]:
    """Greedy tokens of ``prompts``, each answered before the next is queued."""
    settings = dict(device="cpu", max_num_tokens=16, max_batch_size=4, plan_cache=None)  # prompts in chunks
    boot = Bootstrap(BootstrapConfig(model=str(path), **{**settings, **config}))
    try:
        executor = await boot.build()
        tokens = []
        for prompt in prompts:
            rid = executor.enqueue(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
            tokens.append(list(executor.await_response(rid, 60).token_ids))
        return tokens, boot.report().to_dict()["plan"], executor
    finally:
        await boot.aclose()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_pool_answers_and_applies_the_checkpoints_scales(family, tmp_path):
    source = save_checkpoint(family, tmp_path / family)
    full, full_plan, full_executor = anyio.run(answer, source)
    fp8, plan, executor = anyio.run(lambda: answer(source, kv_cache_dtype="fp8"))
    assert [t[0] for t in fp8] == [t[0] for t in full]
    assert (plan["kv_dtype"], plan["kv_scales"], full_plan["kv_dtype"]) == ("fp8", "1.0", "float32")
    spec, full_spec = executor.runner.kv_cache.spec, full_executor.runner.kv_cache.spec
    assert spec.dtype == torch.float8_e4m3fn and spec.bytes_per_token * 4 == full_spec.bytes_per_token
    assert executor.engine_stats().kv_dtype == "fp8" and full_executor.engine_stats().kv_dtype == "float32"
    halves = with_kv_scales(source, tmp_path / f"{family}-scaled", 0.5, 2)
    scaled, scaled_plan, scaled_executor = anyio.run(lambda: answer(halves, kv_cache_dtype="fp8"))
    assert scaled_plan["kv_scales"] == "checkpoint" and scaled == fp8
    assert torch.equal(scaled_executor.runner.kv_cache.scales, torch.full((2, 2), 0.5))
    plain, _, _ = anyio.run(answer, halves)  # a 16-bit pool reads past the scales
    assert plain == full


def test_scales_for_some_layers_only_are_refused_naming_the_layer(tmp_path):
    source = save_checkpoint("llama", tmp_path / "llama")
    partial = with_kv_scales(source, tmp_path / "partial", 0.5, 1)
    with pytest.raises(StageFailed) as info:
        anyio.run(lambda: answer(partial, kv_cache_dtype="fp8"))
    assert info.value.stage == "load_model" and "no k_scale for layer 1" in str(info.value.cause)


def test_new_weights_bring_their_scales_to_the_pool_and_the_plan(tmp_path):
    source = save_checkpoint("llama", tmp_path / "llama")
    halves = with_kv_scales(source, tmp_path / "halves", 0.5, 2)

    async def updated() -> list:
        boot = Bootstrap(BootstrapConfig(model=str(source), device="cpu", kv_cache_dtype="fp8", plan_cache=None))
        seen = []
        try:
            for path in (None, halves, source):
                executor = await boot.build() if path is None else await boot.update_weights(str(path))
                seen.append((executor.runner.kv_cache.scales.tolist(), boot.report().to_dict()["plan"]["kv_scales"]))
            return seen
        finally:
            await boot.aclose()

    ones, halved = [[1.0, 1.0], [1.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]
    assert anyio.run(updated) == [(ones, "1.0"), (halved, "checkpoint"), (ones, "1.0")]


def test_a_draft_of_the_targets_weights_on_fp8_pools_has_every_proposal_accepted(tmp_path):
    """The draft's pool is fp8 with its checkpoint's scales (0.5): read without them, its
    proposals would part from the target's picks."""
    halves = with_kv_scales(save_checkpoint("llama", tmp_path / "llama"), tmp_path / "halves", 0.5, 2)
    alone, _, _ = anyio.run(lambda: answer(halves, kv_cache_dtype="fp8"))
    drafted, _, executor = anyio.run(lambda: answer(halves, kv_cache_dtype="fp8", draft_model=str(halves)))
    draft_pool = executor.speculator.draft.kv_cache
    assert draft_pool.spec.dtype == torch.float8_e4m3fn and torch.equal(draft_pool.scales, torch.full((2, 2), 0.5))
    assert executor.speculator.stats.acceptance_rate == 1.0 and drafted == alone


def test_a_cached_prefix_on_an_fp8_pool_answers_as_the_whole_prompt_in_one_chunk(tmp_path):
    """Blocks of 8, chunks of 40: without the cache each prompt is one chunk attending its own
    keys; with it, the tail reads the 24 prefix tokens an earlier request left in the pool. Both
    see the keys rounded (with a fresh chunk's keys unrounded, this Qwen3's answers differed)."""
    halves = with_kv_scales(save_checkpoint("qwen3", tmp_path / "qwen3"), tmp_path / "halves", 0.5, 2)
    prefix = [(11 * i + 5) % 240 + 3 for i in range(24)]
    prompts = [prefix + tail for tail in ([17, 29, 31], [101, 7], [44, 45, 46, 47, 48, 49, 50])]
    settings = dict(kv_cache_dtype="fp8", tokens_per_block=8, max_num_tokens=40)
    cached, _, executor = anyio.run(lambda: answer(halves, prompts, **settings))
    plain, _, _ = anyio.run(lambda: answer(halves, prompts, prefix_caching=False, **settings))
    assert executor.engine_stats().prefix_hit_tokens == 2 * len(prefix) and cached == plain
