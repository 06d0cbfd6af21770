"""The stages through the trtllm backend on fake TensorRT-LLM objects (1.2.1 and main):
success, OOM in profiling with retry, OOM in final build with a smaller budget, cancellation,
rollback leaving nothing, and the same trace shape as the native (simulated) backend."""

from __future__ import annotations

import anyio
import pytest
from helpers.trtllm_setup import LLAMA, make_setup
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.pipeline.undo import Undo
from bootstrap.stages import STAGE_IDS


def trace_shape(spans) -> list[tuple]:
    """(name, parent name, outcome, attempt / attempts) for every span, in a stable order."""
    by_id = {s.context.span_id: s for s in spans}
    rows = []
    for s in spans:
        parent = by_id[s.parent.span_id].name if s.parent else None
        a = s.attributes
        rows.append(
            (s.name, parent, a.get("bootstrap.outcome"), a.get("bootstrap.attempt"), a.get("bootstrap.attempts"))
        )
    return sorted(rows, key=repr)


async def native_trace(fault: str | None = None, times: int = 1) -> list[tuple]:
    """The same run on the native (simulated) backend, with ``times`` OOMs in stage ``fault``."""
    memory, device = InMemorySpanExporter(), sim_device("h100-80gb")
    if fault:
        device.inject_oom(fault, times)
    config = BootstrapConfig.parse(**{**LLAMA, "backend": "native"})
    pipeline = make_pipeline(config, SimBackend(device), tracer_provider=make_tracer_provider(memory=memory))
    try:
        await pipeline.run()
    finally:
        await pipeline.aclose()
    return trace_shape(memory.get_finished_spans())


async def test_all_stages_succeed_with_the_native_trace_shape(version):
    s = make_setup(version)
    artifacts = await s.pipeline.run()
    # TensorRT-LLM captures its CUDA graphs inside its own executor creation: warmup is skipped
    assert [s.pipeline.status[i].state for i in STAGE_IDS] == [
        "skipped" if i == "warmup" else "done" for i in STAGE_IDS
    ]
    executor = artifacts["executor"]
    assert executor.is_running
    plan, final = artifacts["plan"], artifacts["final"]
    assert final.pool_tokens["target"] == plan.kv_tokens  # the V1 manager holds exactly the planned tokens
    assert final.pool_bytes["target"] == plan.kv_tokens * plan.cost.slope
    assert s.fake.log.count("PyExecutor.__init__ (warmup)") == 2  # estimation executor, final executor
    await s.pipeline.aclose()
    assert not executor.is_running
    assert s.device.live() == {}
    assert trace_shape(s.memory.get_finished_spans()) == await native_trace()
    for sid in STAGE_IDS:
        (span,) = s.spans(f"bootstrap.stage.{sid}")
        assert "bootstrap.device.free_bytes.before" in span.attributes


async def test_profiling_oom_retries_with_half_the_tokens_on_a_rearmed_probe(version):
    """Two dummy steps run out of memory: the first retry shrinks the probe to the dummy workload
    (the plan does not change), the second halves max_num_tokens (the plan records it)."""
    s = make_setup(version)
    s.device.inject_oom("trtllm/forward", 2)  # the worker's dummy step runs out of memory
    artifacts = await s.pipeline.run()
    attempts = s.spans("bootstrap.stage.profiling.attempt")
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "ERROR", "OK"]
    assert "out of memory" in attempts[0].events[0].attributes["exception.message"]
    assert "bootstrap.adapt.max_num_tokens" not in attempts[1].attributes
    assert attempts[1].attributes["bootstrap.adapt.probe_tokens"].startswith("10240 -> ")
    assert attempts[2].attributes["bootstrap.adapt.max_num_tokens"] == "8192 -> 4096"
    assert artifacts["plan"].max_num_tokens == 4096 and artifacts["profile"].max_num_tokens == 4096
    # a shut-down PyExecutor cannot restart and took its KV managers with it: a new probe each time
    assert s.fake.log.count("PyExecutor.__init__ (warmup)") == 4
    assert s.fake.log.count("PyExecutor.shutdown") == 3
    await s.pipeline.aclose()
    assert s.device.live() == {}
    assert trace_shape(s.memory.get_finished_spans()) == await native_trace(fault="profiling", times=2)


async def test_final_build_oom_retries_with_a_smaller_budget(version):
    s = make_setup(version)
    s.device.inject_oom("trtllm/kv/final", 1)
    artifacts = await s.pipeline.run()
    planned = artifacts["budgets"].target
    attempts = s.spans("bootstrap.stage.final_build.attempt")
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "OK"]
    assert (
        attempts[1].attributes["bootstrap.adapt.target_bytes"]
        == f"{planned.gpu_bytes} -> {int(planned.gpu_bytes * 0.9)}"
    )
    smaller = int(planned.gpu_bytes * 0.9) // planned.cost.slope // 32 * 32
    final = artifacts["final"]
    assert final.pool_tokens["target"] == smaller and final.pool_bytes["target"] == smaller * planned.cost.slope
    assert artifacts["executor"].is_running
    await s.pipeline.aclose()
    assert s.device.live() == {}


async def test_exhausted_final_build_keeps_weights_releases_pools_and_retry_resumes(version):
    s = make_setup(version)
    s.device.inject_oom("trtllm/kv/final", 3)
    with pytest.raises(StageFailed) as info:
        await s.pipeline.run()
    assert (info.value.stage, info.value.attempts) == ("final_build", 3)
    live = s.device.live()
    assert set(live) == {"trtllm/weights", "trtllm/sampler"}  # no KV pool, probe, graph or executor left
    artifacts = await s.pipeline.retry()
    assert artifacts["executor"].is_running
    assert s.pipeline.status["load_model"].attempts == 1  # weights were not reloaded
    await s.pipeline.aclose()
    assert s.device.live() == {}


async def test_cancellation_rolls_every_stage_back(version):
    s = make_setup(version)
    reached = anyio.Event()

    async def watch():
        async for event in s.pipeline.events():
            if event.stage == "capacity" and event.kind == "started":
                reached.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        with anyio.CancelScope() as scope:
            tg.start_soon(lambda: s.pipeline.run())
            await reached.wait()
            scope.cancel()
        tg.cancel_scope.cancel()
    await s.pipeline.aclose()
    assert s.device.live() == {}


async def test_draft_model_gets_its_own_pool_from_the_split(version, draft_config):
    s = make_setup(version, draft_model=str(draft_config))
    artifacts = await s.pipeline.run()
    budgets, final, plan = artifacts["budgets"], artifacts["final"], artifacts["plan"]
    assert set(final.pool_bytes) == {"target", "draft"}
    assert budgets.target.gpu_bytes + budgets.draft.gpu_bytes == plan.kv_budget_bytes
    for name, pool in (("target", budgets.target), ("draft", budgets.draft)):
        assert final.pool_tokens[name] == pool.tokens  # each V1 manager built from its own KvCacheConfig copy
    assert "load draft engine " + str(draft_config) in s.fake.log
    await s.pipeline.aclose()
    assert s.device.live() == {}


@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
async def test_sliding_windows_are_allocated_as_priced(kv_manager):
    s = make_setup("main", model="gemma-2-9b", max_num_tokens=2048, max_batch_size=16, kv_manager=kv_manager)
    artifacts = await s.pipeline.run()
    plan, final = artifacts["plan"], artifacts["final"]
    assert final.pool_tokens["target"] // 32 == plan.kv_tokens // 32  # the full-length pool, in blocks
    manager = "KVCacheManagerV2" if kv_manager == "v2" else "KVCacheManager"
    assert artifacts["resolved"].kv_manager == manager
    await s.pipeline.aclose()
    assert s.device.live() == {}


async def test_every_attempt_works_on_a_copy_of_the_users_arguments(version):
    from helpers.fake_trtllm import FakeTrtllm

    probe = make_setup(version)  # a fake installation only to construct the user's TorchLlmArgs
    args_cls, kv_cls = probe.fake.cls("TorchLlmArgs"), probe.fake.cls("KvCacheConfig")
    user_kv = kv_cls(free_gpu_memory_fraction=0.9, tokens_per_block=32)
    user_args = args_cls(
        model="llama-3.1-8b", max_batch_size=64, max_num_tokens=8192, max_seq_len=8192, kv_cache_config=user_kv
    )
    s = make_setup(version, llm_args=user_args)
    assert isinstance(s.fake, FakeTrtllm)
    s.device.inject_oom("trtllm/forward", 1)
    artifacts = await s.pipeline.run()
    assert artifacts["executor"].is_running
    # TensorRT-LLM's creator writes max_tokens, pool_ratio, avg_seq_len, max_gpu_total_bytes in place:
    assert (user_kv.max_tokens, user_kv.avg_seq_len, user_kv.max_gpu_total_bytes) == (None, None, 0)
    assert user_args.max_num_tokens == 8192  # the retry's 4096 went to a copy
    await s.pipeline.aclose()
    assert s.device.live() == {}


async def test_a_never_started_estimation_executor_is_dropped_not_shut_down(version):
    s = make_setup(version)
    from bootstrap.stages.resolve_classes import resolve_classes

    resolved = resolve_classes(s.config, s.backend)
    load_undo, probe_undo = Undo(), Undo()
    loaded = s.backend.load_model(s.config, resolved, load_undo)
    estimation = s.backend.build_estimation(loaded, resolved, 20_000, s.config, probe_undo)
    assert estimation.probe_tokens == 10_240  # TensorRT-LLM's own estimate, below the stage's 20,000
    assert probe_undo.run() == []  # the fake raises if shutdown() were called on it (it would hang)
    assert "PyExecutor.shutdown" not in s.fake.log
    assert set(s.device.live()) == {"trtllm/weights", "trtllm/sampler"}  # warmup graphs released too
    assert load_undo.run() == []
    assert s.device.live() == {}


def test_config_errors_fail_in_resolve_classes(version):
    from bootstrap.stages.resolve_classes import resolve_classes

    def resolve(**overrides):
        s = make_setup(version, **overrides)
        return resolve_classes(s.config, s.backend)

    with pytest.raises(ConfigError, match=r"free_gpu_memory_fraction: 1\.0 .*V1 KVCacheManager"):
        resolve(free_gpu_memory_fraction=1.0)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        resolve(model="llama-3.1-70b", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="backend 'trtllm'"):
        resolve(backend="native")
    if version == "1.2.1":
        with pytest.raises(ConfigError, match=r"needs TensorRT-LLM 1\.3"):
            resolve(kv_manager="v2")
    else:
        assert resolve(kv_manager="v2", free_gpu_memory_fraction=1.0).kv_manager == "KVCacheManagerV2"
