"""Speculative decoding on a CUDA device (float32, TF32 off): greedy output with a draft is the
target's own (transformers' ``generate``) on llama and windowed qwen2, for a draft that agrees
and one that does not, with the worker thread running and 32 requests at once; both pools empty
afterwards. With CUDA graphs captured for the speculative passes (the target's verify rows, the
draft's catching-up rows), every draft and verify pass replays one and none runs eagerly, output
still the target's; and the stages with a draft capture both models' graphs in ``warmup``."""

from __future__ import annotations

import copy

import anyio
import pytest
import torch
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint
from test_engine_cuda import build, prompts, reference

from bootstrap import BootstrapConfig
from bootstrap.api import Bootstrap
from bootstrap.capacity.cuda_graph_buckets import default_batch_sizes, speculative_batch_sizes
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.spec.depth import PROBE_EVERY, ROW_TOKENS
from bootstrap.engine.spec.rows import graph_sizes, speculative_rows
from bootstrap.engine.step.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def drafted(model, draft):
    def pool(m):
        return PagedKVCache.from_tokens(KVCacheSpec.from_config(m.config, torch.float32), 8192, 16, "cuda")

    return create_executor(
        copy.deepcopy(model),
        pool(model),
        SchedulerConfig(32, 48, 256),
        start=True,
        draft=(copy.deepcopy(draft), pool(draft)),
        speculative_tokens=4,
    )


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


def counted(runner: ModelRunner) -> dict[str, int]:
    """Count a runner's graph replays (and the most rows a replayed bucket had) and its eager
    steps of one-token rows."""
    counts = {"replays": 0, "widest_rows": 0, "eager_rows": 0}
    replay, eager = runner.graphs.replay, runner.prepare_decode

    def replayed(bucket):
        counts["replays"] += 1
        counts["widest_rows"] = max(counts["widest_rows"], bucket[0])
        return replay(bucket)

    def eagerly(*args, **kwargs):
        counts["eager_rows"] += 1
        return eager(*args, **kwargs)

    runner.graphs.replay, runner.prepare_decode = replayed, eagerly
    return counts


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_speculative_passes_replay_cuda_graphs(kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, k, batch = build(kind, torch.float32), 4, 8
    rows = speculative_rows(batch, k)
    runners = {}
    for name, per_request, max_rows in (("target", k + 1, rows[0]), ("draft", 2, rows[1])):
        pool = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.float32), 8192, 16, "cuda")
        runners[name] = ModelRunner(copy.deepcopy(model), pool, batch, 256, max_rows=max_rows)
        runners[name].capture_decode_graphs(speculative_batch_sizes(default_batch_sizes(batch), per_request))
    counts = {name: counted(runner) for name, runner in runners.items()}
    target = runners["target"]
    ex = create_executor(
        target.model,
        target.kv_cache,
        SchedulerConfig(batch, 48, 256),
        runner=target,
        draft=runners["draft"],
        speculative_tokens=k,
    )
    asked = prompts(batch)
    try:
        got = [r.token_ids for r in ex.generate(asked, SamplingParams(max_tokens=24))]
        steps = ex.speculator.stats.steps
    finally:
        ex.shutdown()
    assert got == [reference(model, p, 24) for p in asked]
    assert steps > 0 and counts["target"]["eager_rows"] == 0 and counts["draft"]["eager_rows"] == 0
    assert counts["target"]["replays"] >= steps and counts["draft"]["replays"] >= k * steps


def test_auto_catch_ups_after_a_pause_replay_the_drafts_graphs():
    """``auto`` with a draft that disagrees: requests stop speculating, then try one proposal
    every ``PROBE_EVERY`` steps, the draft catching up on up to ``ROW_TOKENS`` tokens of each in
    one pass. With the draft's graphs as ``graph_sizes`` gives them (8 requests × ``ROW_TOKENS``
    rows among them) those passes replay a graph, none runs eagerly, and the output is still the
    target's. The cost figures are held (a draft pass a fifth of a decode step), so tiny models
    whose passes cost the same still speculate."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, batch = build("llama", torch.float32), 8
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    config = BootstrapConfig(
        model="random:llama-3.2-1b",
        draft_model="random:llama-3.2-1b",
        max_batch_size=batch,
        num_speculative_tokens="auto",
    )
    sizes, k = graph_sizes(config, default_batch_sizes(batch)), config.speculative_tokens  # auto's ceiling
    assert batch * ROW_TOKENS in sizes["draft"]
    rows = speculative_rows(batch, k, adaptive=True)
    runners = {}
    for name, weights, max_rows in (("target", model, rows[0]), ("draft", other, rows[1])):
        pool = PagedKVCache.from_tokens(KVCacheSpec.from_config(weights.config, torch.float32), 16384, 16, "cuda")
        runners[name] = ModelRunner(copy.deepcopy(weights), pool, batch, 256, max_rows=max_rows)
        runners[name].capture_decode_graphs(sizes[name])
    counts = counted(runners["draft"])
    target = runners["target"]
    ex = create_executor(
        target.model,
        target.kv_cache,
        SchedulerConfig(batch, 48, 256),
        runner=target,
        draft=runners["draft"],
        speculative_tokens=k,
        adaptive=True,
        start=False,
    )
    costs = ex.speculator.costs
    costs.decode, costs.verify, costs.draft = 1.0, 1.0, 0.2
    costs.record = lambda what, seconds: None
    asked = prompts(batch)
    try:
        got = [r.token_ids for r in ex.generate(asked, SamplingParams(max_tokens=3 * PROBE_EVERY))]
    finally:
        ex.shutdown()
    assert got == [reference(model, p, 3 * PROBE_EVERY) for p in asked]
    assert counts["eager_rows"] == 0 and counts["widest_rows"] > 2 * batch  # a catch-up of more than two rows each


def test_the_stages_capture_the_draft_and_verify_passes(tmp_path):
    """``bootstrap`` with a draft: warmup captures the target's decode and verify rows and the
    draft's passes; the started executor speculates through them."""
    save_checkpoint("llama", tmp_path / "tiny", CHAT_TEMPLATE)
    config = BootstrapConfig(
        model=str(tmp_path / "tiny"),
        draft_model=str(tmp_path / "tiny"),
        device="cuda",
        max_batch_size=8,
        max_seq_len=256,
        num_speculative_tokens=3,
    )
    boot = Bootstrap(config)

    async def start():
        return await boot.build()

    executor = anyio.run(start)
    try:
        warmup = next(row for row in boot.report().stages if row["id"] == "warmup")
        assert warmup["outcome"] == "ok", warmup
        sizes = speculative_batch_sizes(default_batch_sizes(8), 4)
        assert executor.runner.graphs.batch_sizes == tuple(sizes)
        assert executor.speculator.draft.graphs.batch_sizes == tuple(speculative_batch_sizes(default_batch_sizes(8), 2))
        assert executor.speculator.draft.graphs is not None and executor.runner.graphs is not None
        executor.generate([[5, 6, 7]], SamplingParams(max_tokens=12))
        assert executor.speculator.stats.steps > 0
    finally:
        anyio.run(boot.aclose)
