"""The default stages on the simulated backend (a FakeDevice GPU): success, each
retryable failure, rollback to zero simulated bytes, adaptations recorded, resume, cancel."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity import CapacityError
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import DeviceOutOfMemory
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.stage import GiveUp
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages import STAGE_IDS

LLAMA = dict(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)


def setup(gpu="h100-80gb", **overrides):
    device = sim_device(gpu)
    memory = InMemorySpanExporter()
    config = BootstrapConfig.parse(**{**LLAMA, **overrides})
    pipeline = make_pipeline(config, SimBackend(device), tracer_provider=make_tracer_provider(memory=memory))
    return pipeline, device, memory


def by_name(memory, name):
    return [s for s in memory.get_finished_spans() if s.name == name]


async def test_all_stages_succeed_and_release_everything():
    pipeline, device, memory = setup()
    artifacts = await pipeline.run()
    # the simulated GPU captures no CUDA graphs: warmup is skipped (tests/unit/test_warmup_stage.py)
    assert [pipeline.status[s].state for s in STAGE_IDS] == ["skipped" if s == "warmup" else "done" for s in STAGE_IDS]
    plan, final = artifacts["plan"], artifacts["final"]
    assert plan.kv_tokens > 0 and plan.kv_tokens % 32 == 0
    assert final.pool_bytes["target"] == artifacts["budgets"].target.gpu_bytes
    assert "estimation_build/probe_kv" not in device.live()  # consumed by profiling
    assert device.free_bytes() >= 0
    await pipeline.aclose()
    assert device.live() == {}
    assert len(by_name(memory, "bootstrap.pipeline")) == 1
    for sid in STAGE_IDS:
        (span,) = by_name(memory, f"bootstrap.stage.{sid}")
        assert span.attributes["bootstrap.outcome"] == ("skipped" if sid == "warmup" else "ok")
        assert "bootstrap.device.free_bytes.before" in span.attributes


@pytest.mark.parametrize("stage", ["estimation_build", "profiling"])
async def test_oom_shrinks_the_probe_then_halves_max_num_tokens_and_the_plan_records_it(stage):
    pipeline, device, memory = setup()
    device.inject_oom(stage, 2)
    artifacts = await pipeline.run()
    attempts = by_name(memory, f"bootstrap.stage.{stage}.attempt")
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "ERROR", "OK"]
    assert "bootstrap.adapt.max_num_tokens" not in attempts[1].attributes  # the probe's slack goes first
    assert attempts[1].attributes["bootstrap.adapt.probe_tokens"] == "10240 -> 8224"
    assert attempts[2].attributes["bootstrap.adapt.max_num_tokens"] == "8192 -> 4096"
    assert artifacts["plan"].max_num_tokens == 4096
    await pipeline.aclose()
    assert device.live() == {}


async def test_final_build_oom_shrinks_the_budget_a_step():
    pipeline, device, memory = setup()
    device.inject_oom("final_build", 1)
    artifacts = await pipeline.run()
    planned = artifacts["budgets"].target.gpu_bytes
    assert artifacts["final"].pool_bytes["target"] == int(planned * 0.9)
    second = by_name(memory, "bootstrap.stage.final_build.attempt")[1]
    assert second.attributes["bootstrap.adapt.target_bytes"] == f"{planned} -> {int(planned * 0.9)}"
    await pipeline.aclose()
    assert device.live() == {}


async def test_final_build_oom_shrinks_every_pool_not_only_the_target():
    pipeline, device, memory = setup(model="llama-3.1-70b", draft_model="llama-3.1-8b", tensor_parallel_size=4)
    device.inject_oom("final_build", 1)
    artifacts = await pipeline.run()
    planned = {p.name: p.gpu_bytes for p in artifacts["budgets"].pools()}
    assert set(planned) == {"target", "draft"}
    assert artifacts["final"].pool_bytes == {name: int(nbytes * 0.9) for name, nbytes in planned.items()}
    second = by_name(memory, "bootstrap.stage.final_build.attempt")[1]
    for name, nbytes in planned.items():
        assert second.attributes[f"bootstrap.adapt.{name}_bytes"] == f"{nbytes} -> {int(nbytes * 0.9)}"
    await pipeline.aclose()
    assert device.live() == {}


async def test_exhausted_final_build_keeps_weights_and_retry_resumes():
    pipeline, device, _ = setup()
    device.inject_oom("final_build", 3)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("final_build", 3)
    live = device.live()
    assert "load_model/weights" in live and not any(t.startswith("final_build") for t in live)
    weights_loads = pipeline.status["load_model"].attempts
    artifacts = await pipeline.retry()
    assert artifacts["executor"].is_running
    assert pipeline.status["load_model"].attempts == weights_loads  # weights were not reloaded
    await pipeline.aclose()
    assert device.live() == {}


async def test_load_model_oom_is_not_retried():
    pipeline, device, _ = setup()
    device.inject_oom("load_model", 1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("load_model", 1)
    await pipeline.aclose()
    assert device.live() == {}


async def test_config_errors_fail_in_resolve_classes_before_any_allocation():
    pipeline, device, _ = setup(max_seq_len=1_000_000)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.stage == "resolve_classes" and isinstance(info.value.cause, ConfigError)
    assert "max_seq_len" in str(info.value) and "131072" in str(info.value)
    assert device.live() == {} and device.peak_bytes() == 0


async def test_infeasible_plan_names_the_knob():
    pipeline, device, _ = setup(gpu="rtx-4090", model="llama-3.1-70b")
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    # 70B weights cannot load on 24 GiB: the OOM is reported at load_model, not later
    assert info.value.stage == "load_model"
    pipeline, device, _ = setup(gpu="rtx-4090", max_seq_len=131072)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.stage == "capacity" and isinstance(info.value.cause, CapacityError)
    assert "max_seq_len" in str(info.value.cause)
    await pipeline.aclose()
    assert device.live() == {}


async def test_draft_model_split_and_pools():
    pipeline, device, _ = setup(draft_model="smollm2-135m", model="llama-3.1-8b")
    with pytest.raises(StageFailed) as info:
        await pipeline.run()  # SmolLM2's vocab differs from Llama 3's: rejected up front
    assert info.value.stage == "resolve_classes" and "a vocabulary of 49152 tokens" in str(info.value)
    pipeline, device, _ = setup(model="llama-3.1-70b", draft_model="llama-3.1-8b", tensor_parallel_size=4)
    artifacts = await pipeline.run()
    budgets = artifacts["budgets"]
    assert budgets.target.gpu_bytes + budgets.draft.gpu_bytes == artifacts["plan"].kv_budget_bytes
    assert set(artifacts["final"].pool_bytes) == {"target", "draft"}
    await pipeline.aclose()
    assert device.live() == {}


async def test_cancellation_mid_pipeline_rolls_everything_back():
    pipeline, device, _ = setup()
    reached = anyio.Event()

    async def watch():
        async for event in pipeline.events():
            if event.stage == "capacity" and event.kind == "started":
                reached.set()

    with anyio.move_on_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            tg.start_soon(pipeline.run)
            await reached.wait()
            tg.cancel_scope.cancel()
    assert device.live() == {}
    assert all(s.state == "cancelled" for s in pipeline.status.values())


async def test_plan_cache_skips_estimation_and_profiling(tmp_path):
    first, _device1, _ = setup(plan_cache=tmp_path)
    planned = (await first.run())["plan"]
    await first.aclose()
    second, device2, memory = setup(plan_cache=tmp_path)
    artifacts = await second.run()
    for sid in ("estimation_build", "profiling"):
        (span,) = by_name(memory, f"bootstrap.stage.{sid}")
        assert span.attributes["bootstrap.outcome"] == "skipped"
        assert span.attributes["bootstrap.skip_reason"] == "plan-cache"
    assert artifacts["plan"] == planned
    assert not any(t.startswith(("estimation_build", "profiling")) for t in device2.live())
    await second.aclose()
    assert device2.live() == {}


async def test_plan_cache_is_not_used_when_the_device_lacks_room(tmp_path):
    first, _, _ = setup(plan_cache=tmp_path)
    await first.run()
    await first.aclose()
    second, device, memory = setup(plan_cache=tmp_path)
    device.non_torch += 20 * 1024**3  # another process took 20 GiB since the plan was made
    await second.run()
    (span,) = by_name(memory, "bootstrap.stage.profiling")
    assert span.attributes["bootstrap.outcome"] == "ok"
    await second.aclose()


class FlakyDisk(SimBackend):
    """The sim backend whose first weight load dies half way with a transient I/O error."""

    failures = 1

    def load_model(self, config, resolved, undo):
        loaded = super().load_model(config, resolved, undo)  # allocates the weights, then...
        if self.failures:
            self.failures -= 1
            raise ConnectionResetError("connection reset while reading shard 3 of 4")
        return loaded


async def test_load_model_retries_transient_io_and_rolls_back_the_partial_load():
    device = sim_device("h100-80gb")
    memory = InMemorySpanExporter()
    config = BootstrapConfig.parse(**LLAMA)
    pipeline = make_pipeline(config, FlakyDisk(device), tracer_provider=make_tracer_provider(memory=memory))
    await pipeline.run()
    attempts = by_name(memory, "bootstrap.stage.load_model.attempt")
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "OK"]
    assert attempts[0].attributes["error.type"] == "ConnectionResetError"
    assert attempts[0].attributes["bootstrap.rollback.actions"] == 1
    weights = [n for tag, n in device.live().items() if tag == "load_model/weights"]
    assert weights == [16_060_522_496]  # one copy: the failed attempt's weights were released
    await pipeline.aclose()
    assert device.live() == {}


async def test_missing_weights_file_is_not_retried():
    class MissingFile(SimBackend):
        def load_model(self, config, resolved, undo):
            raise FileNotFoundError("model.safetensors not found")

    pipeline = make_pipeline(BootstrapConfig.parse(**LLAMA), MissingFile(sim_device("h100-80gb")))
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("load_model", 1)


async def test_oom_at_the_max_num_tokens_floor_fails_with_the_reason():
    pipeline, device, _memory = setup(max_num_tokens=64, max_batch_size=64)  # already at its floor
    device.inject_oom("profiling", 2)  # the first one shrinks the probe to the dummy workload
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("profiling", 2)
    assert isinstance(info.value.cause, GiveUp)
    assert "max_num_tokens is already 64" in str(info.value) and "max_batch_size" in str(info.value)
    assert isinstance(info.value.cause.__cause__, DeviceOutOfMemory)
    await pipeline.aclose()
    assert device.live() == {}


async def test_final_build_gives_up_rather_than_shrink_below_one_request():
    pipeline, device, _memory = setup(max_kv_tokens=8192)  # exactly one max_seq_len request
    device.inject_oom("final_build", 1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("final_build", 1)
    assert "less than one request of max_seq_len=8192" in str(info.value)
    assert "lower free_gpu_memory_fraction" not in str(info.value)  # no OOM advice contradicting the reason
    await pipeline.aclose()
    assert device.live() == {}


async def test_profiling_retry_halves_what_actually_ran_after_estimation_adapted():
    pipeline, device, memory = setup()
    device.inject_oom("estimation_build", 2)  # a leaner probe, then 8192 -> 4096 for the probe
    device.inject_oom("profiling", 1)  # must now go 4096 -> 2048, not 8192 -> 4096
    artifacts = await pipeline.run()
    second = by_name(memory, "bootstrap.stage.profiling.attempt")[1]
    assert second.attributes["bootstrap.adapt.max_num_tokens"] == "4096 -> 2048"
    assert artifacts["plan"].max_num_tokens == 2048
    await pipeline.aclose()


async def test_plan_cache_hits_at_fraction_one(tmp_path):
    first, _, _ = setup(plan_cache=tmp_path, free_gpu_memory_fraction=1.0)
    await first.run()
    await first.aclose()
    second, _, memory = setup(plan_cache=tmp_path, free_gpu_memory_fraction=1.0)
    await second.run()
    (span,) = by_name(memory, "bootstrap.stage.profiling")
    assert span.attributes["bootstrap.outcome"] == "skipped"
    await second.aclose()


async def test_a_profile_taken_after_an_oom_adaptation_is_not_cached(tmp_path):
    first, device, _ = setup(plan_cache=tmp_path)
    device.inject_oom("profiling", 2)
    assert (await first.run())["plan"].max_num_tokens == 4096
    await first.aclose()
    assert list(tmp_path.glob("*.json")) == []
    second, _, _memory = setup(plan_cache=tmp_path)
    assert (await second.run())["plan"].max_num_tokens == 8192  # profiled afresh at full size
    await second.aclose()


async def test_a_profile_taken_on_a_leaner_probe_is_cached(tmp_path):
    """The probe is added back to the budget: a retry that only shrank it measured the same plan."""
    clean, _, _ = setup()
    unfaulted = (await clean.run())["plan"]
    await clean.aclose()
    first, device, _ = setup(plan_cache=tmp_path)
    device.inject_oom("profiling", 1)
    planned = (await first.run())["plan"]
    await first.aclose()
    assert planned.peak_bytes < unfaulted.peak_bytes  # the peak holds the smaller probe, and
    assert dataclasses.replace(planned, peak_bytes=unfaulted.peak_bytes) == unfaulted  # nothing else moves
    assert len(list(tmp_path.glob("*.json"))) == 1
    second, _, memory = setup(plan_cache=tmp_path)
    assert (await second.run())["plan"] == planned
    (span,) = by_name(memory, "bootstrap.stage.profiling")
    assert span.attributes["bootstrap.outcome"] == "skipped"
    await second.aclose()


async def test_tp_that_does_not_divide_the_draft_heads_names_the_draft(tmp_path):
    draft = tmp_path / "config.json"
    import json

    from bootstrap.capacity.presets import preset_config

    draft.write_text(
        json.dumps(
            {
                **preset_config("llama-3.1-8b"),
                "num_attention_heads": 9,
                "num_key_value_heads": 9,
                "hidden_size": 9 * 128,
                "head_dim": 128,
            }
        )
    )
    pipeline, _, _ = setup(draft_model=str(draft), tensor_parallel_size=2)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert (
        info.value.stage == "resolve_classes"
        and "draft_model" in str(info.value)
        and "9 attention heads" in str(info.value)
    )


async def test_a_draft_with_another_vocabulary_is_refused_naming_both_models_and_sizes():
    pipeline, device, _ = setup(model="llama-3.1-8b", draft_model="qwen2.5-7b")
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    message = str(info.value)
    assert info.value.stage == "resolve_classes" and isinstance(info.value.cause, ConfigError)
    assert "'qwen2.5-7b' has a vocabulary of 152064 tokens" in message and "'llama-3.1-8b' one of 128256" in message
    assert device.live() == {} and device.peak_bytes() == 0


async def test_a_draft_shorter_than_max_seq_len_is_refused_before_any_load_naming_the_draft(tmp_path):
    import json

    from bootstrap.capacity.presets import preset_config

    draft = tmp_path / "config.json"
    draft.write_text(json.dumps({**preset_config("llama-3.2-1b"), "max_position_embeddings": 4096}))
    pipeline, device, _ = setup(draft_model=str(draft))  # max_seq_len 8192
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.stage == "resolve_classes" and isinstance(info.value.cause, ConfigError)
    assert "draft_model:" in str(info.value) and "max_position_embeddings 4096, below max_seq_len 8192" in str(
        info.value
    )
    assert device.peak_bytes() == 0


async def test_a_draft_larger_than_the_target_is_refused_naming_both():
    pipeline, device, _ = setup(model="llama-3.2-1b", draft_model="llama-3.1-8b")
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    message = str(info.value)
    assert info.value.stage == "resolve_classes" and isinstance(info.value.cause, ConfigError)
    assert "draft_model: 'llama-3.1-8b' has" in message and "more than the target 'llama-3.2-1b'" in message
    assert device.peak_bytes() == 0
