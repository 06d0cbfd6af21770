"""CUDA graphs on a CUDA device: float32 greedy parity with generate() through captured decode
graphs (batch sizes between buckets, requests finishing mid-batch, sliding windows), the
bootstrap's warmup stage (traced capture, measured and reserved memory) and a worst-case load
after it."""

from __future__ import annotations

import copy
import json

import anyio
import pytest
import torch
from test_engine_cuda import SHAPE, build, prompts, reference

import bootstrap
from bootstrap.devices import CudaDevice
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.step.graphs import release_workspaces

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def graphed_executor(
    model,
    dtype,
    batch_sizes,
    kernel="auto",
    widths=(1, 2, 4, 8),
    max_batch_size=16,
    tokens_per_block=16,
    max_seq_len=256,
):
    spec = KVCacheSpec.from_config(model.config, dtype)
    cache = PagedKVCache.from_tokens(spec, 8192, tokens_per_block, "cuda")
    config = SchedulerConfig(max_batch_size, 64, max_seq_len)
    ex = create_executor(copy.deepcopy(model), cache, config, start=False)
    ex.runner.decode_kernel = ex.runner._decode_kernel(kernel)
    capture = ex.runner.capture_decode_graphs(batch_sizes, widths=widths)
    replays: list[tuple[int, int]] = []
    replay = ex.runner.graphs.replay
    ex.runner.graphs.replay = lambda bucket: replays.append(bucket) or replay(bucket)
    ex.start_worker()
    return ex, capture, replays


@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_greedy_parity_through_padded_graphs_with_requests_finishing_mid_batch(kind, kernel):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(kind, torch.float32)
    batch = prompts(13)
    lengths = [2, 12, 5, 20, 9, 1, 16, 7, 3, 11, 14, 6, 4]  # the batch shrinks step after step
    ex, capture, replays = graphed_executor(model, torch.float32, [1, 2, 4, 8, 16], kernel)
    assert capture.num_graphs == 20 and capture.batch_sizes == (1, 2, 4, 8, 16) and capture.widths == (1, 2, 4, 8)
    responses = ex.generate(batch, [SamplingParams(max_tokens=n) for n in lengths])
    mismatched = [
        i for i, (p, n, r) in enumerate(zip(batch, lengths, responses)) if r.token_ids != reference(model, p, n)
    ]
    assert not mismatched
    rows = {b for b, _ in replays}
    assert {16, 8, 4} <= rows and len({w for _, w in replays}) >= 2  # 13 rows padded to 16, fewer as requests finish
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()
    assert ex.runner.graphs is None and ex.runner.kv_cache.released


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_each_step_size_between_buckets_matches_eager(kernel):
    """Every batch size 1..8 over buckets 1, 2, 4, 8: the same greedy tokens as without graphs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    for size in range(1, 9):
        batch = prompts(size)
        ex, _, replays = graphed_executor(
            model, torch.float32, [1, 2, 4, 8], kernel
        )  # widths to 128 tokens: every step
        spec = KVCacheSpec.from_config(model.config, torch.float32)
        eager = create_executor(
            copy.deepcopy(model),
            PagedKVCache.from_tokens(spec, 8192, 16, "cuda"),
            SchedulerConfig(16, 64, 256),
            start=True,
        )
        got = [r.token_ids for r in ex.generate(batch, SamplingParams(max_tokens=6))]
        want = [r.token_ids for r in eager.generate(batch, SamplingParams(max_tokens=6))]
        assert got == want, f"batch of {size}"
        assert next(b for b in (1, 2, 4, 8) if b >= size) in {b for b, _ in replays}  # padded up to its bucket
        ex.shutdown()
        eager.shutdown()


def test_cublas_workspaces_outlive_every_live_capture():
    """Graphs replay their GEMMs into the cuBLAS workspace they were captured with: while a
    capture is alive no release frees it (freeing it faulted a batch-112 replay of an 8B model
    with an illegal memory access); after every capture is released, a release frees them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    batch = prompts(8)
    ex, _, replays = graphed_executor(model, torch.float32, [8])
    want = [r.token_ids for r in ex.generate(batch, SamplingParams(max_tokens=4))]
    assert release_workspaces() is False  # a capture is alive
    CudaDevice().empty_cache()
    big = [
        torch.empty(32 * 1024**2, dtype=torch.uint8, device="cuda").fill_(255) for _ in range(8)
    ]  # reuse freed memory
    assert [r.token_ids for r in ex.generate(batch, SamplingParams(max_tokens=4))] == want and replays
    del big
    ex.shutdown()  # releases the graphs
    assert release_workspaces() is True


def test_capture_needs_an_empty_pool():
    model = build("llama", torch.float32)
    spec = KVCacheSpec.from_config(model.config, torch.float32)
    cache = PagedKVCache.from_tokens(spec, 1024, 16, "cuda")
    ex = create_executor(copy.deepcopy(model), cache, SchedulerConfig(4, 64, 128), start=False)
    cache.allocate("busy", 3)
    with pytest.raises(RuntimeError, match="empty KV pool"):
        ex.runner.capture_decode_graphs([1, 2])
    assert ex.runner.graphs is None
    ex.shutdown()


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"model_type": "llama", **SHAPE, "max_position_embeddings": 4096, "torch_dtype": "float32"})
    )
    return path


def test_bootstrap_captures_in_warmup_traces_it_and_survives_a_worst_case_load(tiny_config, tmp_path):
    """Run with anyio (the GPU suite runs pytest without its async plugins)."""
    anyio.run(_bootstrap_captures_in_warmup_traces_it_and_survives_a_worst_case_load, tiny_config, tmp_path)


async def _bootstrap_captures_in_warmup_traces_it_and_survives_a_worst_case_load(tiny_config, tmp_path):
    trace = tmp_path / "trace.jsonl"
    config = bootstrap.BootstrapConfig(
        model=f"random:{tiny_config}",
        device="cuda",
        dtype="float32",
        max_seq_len=2048,
        max_batch_size=16,
        max_num_tokens=2048,
    )
    ex, report = await bootstrap.build_executor(config, trace_file=trace)
    try:
        stages = {row["id"]: row for row in report.stages}
        assert stages["warmup"]["outcome"] == "ok"
        spans = [json.loads(line) for line in trace.read_text().splitlines()]
        (warmup,) = [s for s in spans if s["name"] == "bootstrap.stage.warmup"]
        attrs = warmup["attributes"]
        widths = attrs["bootstrap.warmup.widths"]  # the Triton kernel needs one width, the gather path four
        assert widths in ([64], [8, 16, 32, 64]) and ex.runner.decode_kernel == (
            "triton" if widths == [64] else "torch"
        )
        assert attrs["bootstrap.warmup.batch_sizes"] == [1, 2, 4, 8, 16] and attrs[
            "bootstrap.warmup.graphs"
        ] == 5 * len(widths)
        assert attrs["bootstrap.warmup.graph_bytes"] > 0 and attrs["bootstrap.warmup.reserved_bytes"] > 0
        assert attrs["bootstrap.warmup.graph_bytes"] <= attrs["bootstrap.warmup.reserved_bytes"]  # the estimate holds
        assert warmup["end_time_unix_nano"] > warmup["start_time_unix_nano"]
        assert report.plan["graph_bytes"] == attrs["bootstrap.warmup.reserved_bytes"]
        assert ex.runner.graphs is not None
        # worst case after capture: a full max_num_tokens prefill beside a full batch of decodes
        long = [[t % 200 + 3 for t in range(1900)]]
        short = [[5 + i, 6, 7] for i in range(15)]
        responses = ex.generate(long + short, SamplingParams(max_tokens=40, ignore_eos=True))
        assert all(r.ok and len(r.token_ids) == 40 for r in responses)
    finally:
        ex.shutdown()


def test_bfloat16_graph_logits_match_eager_logits():
    """The Triton kernel in bfloat16 against the eager path on the same step (close, not equal)."""
    model = build("llama", torch.bfloat16)
    ex, _, _ = graphed_executor(model, torch.bfloat16, [1, 2, 4, 8])
    spec = KVCacheSpec.from_config(model.config, torch.bfloat16)
    eager = create_executor(
        copy.deepcopy(model), PagedKVCache.from_tokens(spec, 8192, 16, "cuda"), SchedulerConfig(16, 64, 256), start=True
    )
    batch = prompts(6)
    got = ex.generate(batch, SamplingParams(max_tokens=3))
    want = eager.generate(batch, SamplingParams(max_tokens=3))
    assert sum(g.token_ids[:2] == w.token_ids[:2] for g, w in zip(got, want)) >= 5  # near-ties may flip one
    ex.shutdown()
    eager.shutdown()
