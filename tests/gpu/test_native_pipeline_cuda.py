"""The eight stages through the native backend on a CUDA device, with real memory.

A tiny float32 checkpoint answers exactly as transformers' ``generate()`` on the same GPU; an
8B-shape random model in bfloat16 fills the GPU with its KV pool as the plan says; a real
out-of-memory error (the process's memory capped with ``torch.cuda.set_per_process_memory_fraction``
between what a ``max_num_tokens`` forward needs and what half of it needs) makes profiling retry
with a halved ``max_num_tokens``; a second start finds its plan in the cache. After a shutdown, a
failed start and a cancelled one, torch's allocated bytes are back where they were before and no
``bootstrap*`` thread is left.

Memory is compared after a first complete start in this process (``cuda_warm``): cuBLAS keeps a
workspace per handle, allocated through torch on first use by a thread, for the process's life.
"""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import anyio
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from helpers.tiny_models import save_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import bootstrap  # noqa: E402
from bootstrap.api import Bootstrap  # noqa: E402
from bootstrap.capacity import dummy_workload_tokens  # noqa: E402
from bootstrap.config import BootstrapConfig  # noqa: E402
from bootstrap.devices import CudaDevice  # noqa: E402
from bootstrap.engine.sampling.sampler import SamplingParams  # noqa: E402
from bootstrap.engine.step.graphs import release_workspaces  # noqa: E402
from bootstrap.pipeline import StageFailed  # noqa: E402
from bootstrap.stages import STAGE_IDS  # noqa: E402

DEVICE = "cuda"
MIB, GIB = 1024**2, 1024**3
LLAMA_8B = dict(model="random:llama-3.1-8b", max_seq_len=4096, max_num_tokens=4096, max_batch_size=32)
LLAMA_1B = dict(model="random:llama-3.2-1b", max_seq_len=2048, max_num_tokens=2048, max_batch_size=16)
WEIGHTS_8B, WEIGHTS_1B = 2 * 8_030_261_248, 2 * 1_235_814_400  # bfloat16 parameters


def config(**values) -> BootstrapConfig:
    return BootstrapConfig(device=DEVICE, **values)


def settled_bytes() -> int:
    """Torch's allocated bytes once garbage is collected and the device is idle, cuBLAS workspaces
    freed as a release frees them once no graph is alive (else a baseline taken with the default
    stream's 32 MiB workspace alive differs from one taken after a start released it)."""
    gc.collect()
    torch.cuda.synchronize()
    assert release_workspaces(), "a CUDA graph capture is still alive"
    CudaDevice().empty_cache()
    return torch.cuda.memory_allocated()


def bootstrap_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bootstrap")]


def assert_released(before: int) -> None:
    left = settled_bytes() - before
    assert left == 0, f"{left:,} bytes still allocated on the GPU"
    assert bootstrap_threads() == []


def prompts(count: int, vocab: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module", autouse=True)
def cuda_warm(ckpt):
    """One complete start and release: every thread's cuBLAS workspace exists before a test
    compares allocated bytes."""

    async def start_once() -> None:
        async with bootstrap.executor(
            config(model=str(ckpt), max_num_tokens=64, max_batch_size=4, max_kv_tokens=4096)
        ) as ex:
            assert ex.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].ok

    anyio.run(start_once)
    settled_bytes()


# ---- parity and a real-size model -------------------------------------------------------------


def test_tiny_float32_greedy_output_equals_transformers_generate_on_the_gpu(ckpt):
    anyio.run(_tiny_float32_greedy_output_equals_transformers_generate_on_the_gpu, ckpt)


async def _tiny_float32_greedy_output_equals_transformers_generate_on_the_gpu(ckpt):
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        batch = prompts(12, 256)
        cfg = config(model=str(ckpt), dtype="float32", max_num_tokens=48, max_batch_size=8, max_kv_tokens=8192)
        boot = Bootstrap(cfg)
        try:
            ex = await boot.build()
            responses = ex.generate(batch, SamplingParams(max_tokens=16))
            assert [row["outcome"] for row in boot.report().stages] == ["ok"] * len(STAGE_IDS)
            assert next(ex.runner.model.parameters()).dtype == torch.float32
            assert ex.runner.device.type == torch.device(DEVICE).type
        finally:
            await boot.aclose()
        reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(DEVICE).eval()
        expected = [generate(reference, p, 16) for p in batch]
        assert [r.token_ids for r in responses] == expected
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32


def generate(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt) :].tolist()


def test_8b_bf16_start_fills_the_gpu_as_planned_and_serves():
    anyio.run(_8b_bf16_start_fills_the_gpu_as_planned_and_serves)


async def _8b_bf16_start_fills_the_gpu_as_planned_and_serves():
    before = settled_bytes()
    boot = Bootstrap(config(**LLAMA_8B))
    try:
        ex = await boot.build()
        report = boot.report()
        assert [row["outcome"] for row in report.stages] == ["ok"] * len(STAGE_IDS)
        check_8b_plan(report.plan, ex, before)
        responses = ex.generate(prompts(6, 128256), SamplingParams(max_tokens=16, ignore_eos=True))
        assert all(r.ok and len(r.token_ids) == 16 for r in responses)
    finally:
        await boot.aclose()
    del ex, boot
    assert_released(before)


def check_8b_plan(plan: dict, ex, before: int) -> None:
    profile, pool = plan["profile"], ex.scheduler.kv_cache.stats()
    assert next(ex.runner.model.parameters()).dtype == torch.bfloat16
    assert profile["model_bytes"] - before >= WEIGHTS_8B  # weights (and the probe executor's state)
    left = profile["total_bytes"] - profile["peak_bytes"] - profile["graph_bytes"] + profile["probe_kv_bytes"]
    # no memory rule given: the native default headroom (native_headroom), everything else is KV
    assert 0 < plan["headroom_bytes"] < 3 * 2**30 and plan["fraction"] == 0.9
    assert plan["limited_by"] == "memory" and plan["planned_kv_budget_bytes"] == left - plan["headroom_bytes"]
    assert (
        pool.total_bytes
        == plan["kv_budget_bytes"]
        > plan["planned_kv_budget_bytes"] - pool.total_bytes // pool.total_blocks
    )
    assert torch.cuda.memory_allocated() >= before + WEIGHTS_8B + pool.total_bytes  # really on the GPU
    free, total = torch.cuda.mem_get_info()
    outside_torch_now = total - free - torch.cuda.memory_reserved()
    # cached activation blocks are not counted as memory outside torch
    assert profile["peak_bytes"] - profile["torch_peak_bytes"] <= outside_torch_now + 256 * MIB


# ---- a real out-of-memory error -------------------------------------------------------------


def test_a_real_oom_in_profiling_retries_with_half_max_num_tokens(tmp_path):
    """Calibrated on this GPU: a first start measures what the forward of 16,384 tokens needs;
    then the process may reserve only halfway between that and what 8,192 tokens need."""
    anyio.run(_a_real_oom_in_profiling_retries_with_half_max_num_tokens, tmp_path)


async def _a_real_oom_in_profiling_retries_with_half_max_num_tokens(tmp_path):
    shape = dict(model="random:llama-3.2-1b", max_seq_len=2048, max_num_tokens=16384, max_batch_size=16)
    workload = dummy_workload_tokens(max_num_tokens=16384, max_seq_len=2048, tokens_per_block=32)
    cfg = config(**shape, max_kv_tokens=workload)  # probe = the dummy workload; the final pool as large
    base, room, weights = await calibrate(cfg)
    allowed = torch.cuda.memory_reserved() + weights + room
    torch.cuda.set_per_process_memory_fraction(allowed / torch.cuda.mem_get_info()[1])
    trace = tmp_path / "trace.jsonl"
    boot = Bootstrap(cfg, trace_file=trace)
    try:
        ex = await boot.build()
        assert ex.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].ok
        plan = boot.report().plan
    finally:
        await boot.aclose()
        torch.cuda.set_per_process_memory_fraction(1.0)
    del ex, boot
    check_oom_retry(trace, plan)
    assert_released(base)


async def calibrate(cfg: BootstrapConfig) -> tuple[int, int, int]:
    """Allocated bytes before a start, the room to allow beside weights and executor state, and
    those weights and state, from a first start of ``cfg`` without a cap."""
    base = settled_bytes()
    _, plan = await start_and_report(cfg)
    profile = plan["profile"]
    per_token = 2 * 16 * 8 * 64 * 2  # llama-3.2-1b, bfloat16
    probe_full = profile["probe_kv_bytes"]
    probe_half = dummy_workload_tokens(max_num_tokens=8192, max_seq_len=2048, tokens_per_block=32) * per_token
    fails = probe_full + profile["activation_bytes"]
    passes = probe_half + profile["activation_bytes"] // 2
    room = (fails + passes) // 2
    assert fails - passes >= 256 * MIB and room >= probe_full + 64 * MIB, f"calibration too tight: {profile}"
    settled_bytes()
    return base, room, profile["model_bytes"] - base


def check_oom_retry(trace: Path, plan: dict) -> None:
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    attempts = [s for s in spans if s["name"] == "bootstrap.stage.profiling.attempt"]
    assert 2 <= len(attempts) <= 3 and attempts[-1]["attributes"]["bootstrap.outcome"] == "ok"
    first = attempts[0]
    assert first["status"] == "ERROR" and first["attributes"]["error.type"] == "ProbeOutOfMemory"
    message = next(e["attributes"]["exception.message"] for e in first["events"] if e["name"] == "exception")
    assert "out of memory" in message.lower()
    assert attempts[1]["attributes"]["bootstrap.adapt.max_num_tokens"] == "16384 -> 8192"
    assert plan["max_num_tokens"] == plan["profile"]["max_num_tokens"] <= 8192


# ---- plan cache -----------------------------------------------------------------------------


def test_second_start_finds_its_plan_in_the_cache(tmp_path):
    anyio.run(_second_start_finds_its_plan_in_the_cache, tmp_path)


async def _second_start_finds_its_plan_in_the_cache(tmp_path):
    cfg = config(**LLAMA_1B, plan_cache=tmp_path)
    first, first_plan = await start_and_report(cfg)
    second, second_plan = await start_and_report(cfg)
    assert {row["outcome"] for row in first} == {"ok"}
    skipped = {row["id"]: (row["outcome"], row["skip_reason"]) for row in second if row["outcome"] != "ok"}
    assert skipped == {"estimation_build": ("skipped", "plan-cache"), "profiling": ("skipped", "plan-cache")}
    assert second_plan["kv_tokens"] == first_plan["kv_tokens"] and len(list(tmp_path.glob("*.json"))) == 1


async def start_and_report(cfg: BootstrapConfig) -> tuple[list[dict], dict]:
    """Start, serve one request, release; the stage rows and the plan."""
    boot = Bootstrap(cfg)
    try:
        ex = await boot.build()
        assert ex.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].ok
        report = boot.report()
    finally:
        await boot.aclose()
    return report.stages, report.plan


# ---- release after shutdown, failure and cancellation -----------------------------------------


def test_shutdown_releases_every_byte_and_thread():
    anyio.run(_shutdown_releases_every_byte_and_thread)


async def _shutdown_releases_every_byte_and_thread():
    before = settled_bytes()
    ex, report = await bootstrap.build_executor(config(**LLAMA_1B))
    assert report.plan["kv_budget_bytes"] > GIB and bootstrap_threads() == ["bootstrap-executor"]
    assert ex.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].ok
    ex.shutdown()
    del ex
    assert_released(before)


def test_a_failed_start_keeps_the_weights_for_retry_and_aclose_releases_them():
    """A real failure after the weights and the profile: the plan cannot hold one request."""
    anyio.run(_a_failed_start_keeps_the_weights_for_retry_and_aclose_releases_them)


async def _a_failed_start_keeps_the_weights_for_retry_and_aclose_releases_them():
    before = settled_bytes()
    boot = Bootstrap(config(**{**LLAMA_1B, "max_num_tokens": 512, "max_kv_tokens": 1024}))
    with pytest.raises(StageFailed) as info:
        await boot.build()
    assert info.value.stage == "capacity" and "max_kv_tokens" in str(info.value)
    assert settled_bytes() - before >= WEIGHTS_1B  # the weights, kept for retry()
    await boot.aclose()
    del boot, info
    assert_released(before)


def test_cancellation_mid_start_rolls_everything_back():
    anyio.run(_cancellation_mid_start_rolls_everything_back)


async def _cancellation_mid_start_rolls_everything_back():
    before = settled_bytes()
    boot = Bootstrap(config(**LLAMA_1B))

    # boot passed in, not closed over: the `del boot` below must be what releases it
    async def cancel_when_profiling_starts(boot: Bootstrap, scope: anyio.CancelScope) -> None:
        async for event in boot.events():
            if (event.stage, event.kind) == ("profiling", "started"):
                scope.cancel()
                return

    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_when_profiling_starts, boot, tg.cancel_scope)
            tg.start_soon(boot.build)
    states = {stage: status.state for stage, status in boot.pipeline.status.items()}
    assert "cancelled" in states.values() and states["scheduler_sampler"] != "done"
    await boot.aclose()
    del boot
    assert_released(before)
