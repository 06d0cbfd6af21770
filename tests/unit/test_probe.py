"""The estimation probe across ``estimation_build`` and ``profiling`` (issue 6 item 6, issue 10):
the cap counts what is allocated beside the probe, a profiling OOM rebuilds a smaller probe,
no retry repeats the attempt that failed, and the probe is sized as TensorRT-LLM sizes it."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.sim.backend import SimBackend, executor_state_bytes
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity import GIB, CapacityError, dummy_workload_tokens
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.stage import GiveUp
from bootstrap.pipeline.telemetry import make_tracer_provider

LAYER_8B = 131_072  # Llama-3.1-8B KV bytes per token: 2 x 32 layers x 8 heads x 128 x bf16


def setup(gpu: str, **fields):
    device = sim_device(gpu)
    memory = InMemorySpanExporter()
    config = BootstrapConfig.parse(**{"model": "llama-3.1-8b", **fields})
    backend = SimBackend(device)
    pipeline = make_pipeline(config, backend, tracer_provider=make_tracer_provider(memory=memory))
    return pipeline, device, memory


def attempts(memory, stage):
    return [s for s in memory.get_finished_spans() if s.name == f"bootstrap.stage.{stage}.attempt"]


def stage_span(memory, stage):
    (span,) = [s for s in memory.get_finished_spans() if s.name == f"bootstrap.stage.{stage}"]
    return span


async def close(pipeline, device):
    await pipeline.aclose()
    assert device.live() == {}


# -- issue 6 item 6: the cap, the rebuild, no identical retry ----------------------------------------


async def test_the_cap_leaves_room_for_the_executor_state_allocated_beside_the_probe():
    """21 GiB, 1024 sequences: a 1.96 GiB sampler workspace beside the probe. Before, the probe was
    capped to 0.9 x 5.46 GiB free as if nothing else were allocated, and estimation_build failed."""
    pipeline, device, memory = setup("21GiB", max_seq_len=2048, max_batch_size=1024)
    artifacts = await pipeline.run()
    assert [a.status.status_code.name for a in attempts(memory, "estimation_build")] == ["OK"]
    plan = artifacts["plan"]
    assert plan.kv_tokens == 23_904 and plan.max_num_tokens == 2048  # "about 23,900" in the issue
    span = stage_span(memory, "estimation_build")
    free = span.attributes["bootstrap.device.free_bytes.before"]
    state = executor_state_bytes(artifacts["resolved"], artifacts["config"])
    probe = span.attributes["bootstrap.kv.probe_bytes"]
    assert probe + state <= free and probe <= 0.9 * (free - state)
    await close(pipeline, device)


async def test_a_profiling_oom_rebuilds_the_probe_for_the_halved_workload():
    """524,288 tokens on an H100: the forward does not fit beside a 57 GiB probe. Before, the probe
    stayed and three attempts failed (58.3, 29.2, 14.6 GiB against 6.3 GiB free)."""
    pipeline, device, memory = setup("h100-80gb", max_num_tokens=524_288)
    artifacts = await pipeline.run()
    tries = attempts(memory, "profiling")
    assert [a.status.status_code.name for a in tries] == ["ERROR", "OK"]
    assert tries[1].attributes["bootstrap.adapt.max_num_tokens"] == "524288 -> 262144"
    lean = dummy_workload_tokens(max_num_tokens=262_144, max_seq_len=131_072, tokens_per_block=32)
    assert lean == 262_176
    assert tries[1].attributes["bootstrap.adapt.probe_tokens"].endswith(f"-> {lean}")
    profile = artifacts["profile"]
    assert profile.probe_kv_bytes == lean * LAYER_8B and profile.max_num_tokens == 262_144
    assert profile.model_bytes == artifacts["loaded"].weight_bytes + executor_state_bytes(
        artifacts["resolved"], artifacts["config"]
    )
    assert artifacts["plan"].max_num_tokens == 262_144
    assert not any(t.startswith(("estimation_build", "profiling")) for t in device.live())
    await close(pipeline, device)


async def test_at_fraction_one_the_probe_shrinks_and_the_real_limit_is_reported():
    """RTX 4090, free_gpu_memory_fraction 1: before, three identical OOMs (an 8.45 GiB probe in
    8.39 GiB free). Now the probe fits beside the executor state, the forward's OOM shrinks the probe
    to the dummy workload (max_num_tokens kept), and capacity reports why 131,072 tokens cannot fit."""
    pipeline, device, memory = setup("rtx-4090", free_gpu_memory_fraction=1.0)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.stage == "capacity" and isinstance(info.value.cause, CapacityError)
    assert "max_seq_len=131072" in str(info.value)
    assert "raise free_gpu_memory_fraction" not in str(info.value)  # 1.0 is already its maximum
    assert [a.status.status_code.name for a in attempts(memory, "estimation_build")] == ["OK"]
    tries = attempts(memory, "profiling")
    assert [a.status.status_code.name for a in tries] == ["ERROR", "OK"]
    assert "bootstrap.adapt.max_num_tokens" not in tries[1].attributes  # the probe's slack was enough
    assert tries[1].attributes["bootstrap.adapt.probe_tokens"].endswith("-> 2080")
    assert pipeline.artifacts["profile"].max_num_tokens == 2048
    await close(pipeline, device)


async def test_every_retry_changes_what_failed_and_the_advice_names_what_is_left():
    pipeline, device, memory = setup("h100-80gb", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)
    device.inject_oom("profiling", 3)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    tries = attempts(memory, "profiling")
    assert len(tries) == 3
    changes = [{k: v for k, v in a.attributes.items() if k.startswith("bootstrap.adapt.")} for a in tries[1:]]
    assert changes == [
        {"bootstrap.adapt.probe_tokens": "10240 -> 8224"},  # the estimation floor's slack first
        {"bootstrap.adapt.max_num_tokens": "8192 -> 4096", "bootstrap.adapt.probe_tokens": "8224 -> 4128"},
    ]
    message = str(info.value)
    assert "max_num_tokens=4096" in message and "4,128 tokens" in message  # what the last attempt ran
    assert "below the value above" in message and "max_batch_size" in message
    assert "lower max_num_tokens or max_batch_size." not in message  # not what was already done
    await close(pipeline, device)


async def test_an_estimation_oom_shrinks_the_probe_and_never_rebuilds_the_same_one():
    pipeline, device, memory = setup("h100-80gb", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)
    device.inject_oom("estimation_build", 2)
    artifacts = await pipeline.run()
    tries = attempts(memory, "estimation_build")
    assert [a.attributes.get("bootstrap.adapt.probe_tokens") for a in tries] == [None, "10240 -> 8224", "8224 -> 4128"]
    assert tries[2].attributes["bootstrap.adapt.max_num_tokens"] == "8192 -> 4096"
    assert artifacts["plan"].max_num_tokens == 4096
    await close(pipeline, device)


async def test_an_estimation_oom_with_a_probe_capped_by_memory_gives_up_at_once():
    """The probe is already capped to what the free memory holds and the dummy workload of every
    max_num_tokens down to its floor is larger: a retry would build the same probe."""
    room = 6 * 1024**2  # free beyond weights and executor state: 0.9 x 6 MiB holds one block of 32 tokens
    gpu = str(623_706_112 + 16_060_522_496 + 131_399_680 + room)  # CUDA context + weights + state (64 slots)
    pipeline, device, _memory = setup(gpu, max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)
    device.inject_oom("estimation_build/probe_kv", 1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("estimation_build", 1)
    assert isinstance(info.value.cause, GiveUp) and "cannot shrink" in str(info.value)
    await close(pipeline, device)


async def test_retry_after_profiling_failed_rebuilds_the_probe_it_released():
    pipeline, device, _memory = setup("h100-80gb", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)
    device.inject_oom("profiling", 3)  # attempt 2 released the original probe for a smaller one
    with pytest.raises(StageFailed):
        await pipeline.run()
    assert not any(t.startswith(("estimation_build", "profiling")) for t in device.live())
    artifacts = await pipeline.retry()
    profile = artifacts["profile"]
    assert profile.model_bytes == artifacts["loaded"].weight_bytes + executor_state_bytes(
        artifacts["resolved"], artifacts["config"]
    )
    assert profile.max_num_tokens == 8192 and artifacts["executor"].is_running
    await close(pipeline, device)


async def test_the_readme_worked_example_is_unchanged():
    """README, Llama-3.1-8B on an H100: every figure of its table (the probe changes move none)."""
    pipeline, device, _ = setup("h100-80gb")
    artifacts = await pipeline.run()
    plan, profile = artifacts["plan"], artifacts["profile"]
    assert (plan.kv_budget_bytes, plan.kv_tokens, plan.max_concurrent_requests) == (61_199_703_244, 466_912, 3)
    assert profile.total_bytes == 85_027_979_264 and profile.probe_kv_bytes == 17_314_086_912 == 132_096 * LAYER_8B
    assert profile.model_bytes == 16_060_522_496 + 66_191_360  # weights + executor state
    assert profile.activation_bytes == 277_889_024 and profile.peak_bytes == 34_342_395_904
    await close(pipeline, device)


# -- issue 10: the probe's size as TensorRT-LLM sizes it ---------------------------------------------


async def test_the_probe_is_capped_by_max_kv_tokens():
    """TensorRT-LLM's try_prepare_estimation probes min(estimate, max_tokens)."""
    pipeline, device, memory = setup(
        "h100-80gb", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64, max_kv_tokens=9000
    )
    await pipeline.run()
    span = stage_span(memory, "estimation_build")
    assert span.attributes["bootstrap.kv.probe_tokens"] == 9000 // 32 * 32  # not the estimate's 10,240
    await close(pipeline, device)


async def test_the_probe_is_capped_by_max_kv_bytes():
    pipeline, device, memory = setup(
        "h100-80gb", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64, max_kv_bytes=GIB
    )
    await pipeline.run()
    span = stage_span(memory, "estimation_build")
    assert span.attributes["bootstrap.kv.probe_tokens"] == GIB // LAYER_8B // 32 * 32
    await close(pipeline, device)


async def test_a_sliding_window_probe_holds_its_tokens_in_every_layer_not_every_batch_slots_window():
    """Gemma-2-9B, 32 sequences: TensorRT-LLM's V1 estimation pools give every window the probe's
    blocks (9,216 tokens x 42 layers x 8,192 B = 3.17 GB); the plan's per-sequence window state
    (32 x 21 x 4,096 x 8,192 B = 22.5 GB) is for max_batch_size live sequences, not the dummies."""
    pipeline, device, memory = setup("h100-80gb", model="gemma-2-9b")
    artifacts = await pipeline.run()
    span = stage_span(memory, "estimation_build")
    assert span.attributes["bootstrap.kv.probe_tokens"] == 9216
    assert span.attributes["bootstrap.kv.probe_bytes"] == 9216 * 42 * 8192 == 3_170_893_824
    assert artifacts["resolved"].cost.intercept == 32 * 21 * 4096 * 8192  # the plan still prices the windows
    await close(pipeline, device)
