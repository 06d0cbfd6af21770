"""The optional ``warmup`` stage on mocked GPUs: a simulated backend that "captures" CUDA graphs
(allocations on the FakeDevice), measured in profiling and reserved by the plan; OOM retries with
fewer batch sizes, rollback to zero bytes, skip reasons, the warmup handed to the executor."""

from __future__ import annotations

import dataclasses

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.artifacts import Warmup
from bootstrap.backends.sim.backend import SimBackend, allocate
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity import CacheCost, MemoryProfile, plan_capacity
from bootstrap.capacity.cuda_graph_buckets import graph_batch_sizes
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages import STAGE_IDS
from bootstrap.stages.warmup import skip_warmup

LLAMA = dict(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, max_batch_size=32)
MiB = 1 << 20


class GraphSim(SimBackend):
    """The simulated GPU with graph capture: 8 MiB per captured batch size, the same figure
    measured in profiling (as the native backend captures the same buckets on the probe)."""

    started_with: Warmup | None = None

    @staticmethod
    def graph_bytes(batch_sizes) -> int:
        return 8 * MiB * len(batch_sizes)

    def profile(self, estimation, loaded, max_num_tokens, config, undo) -> MemoryProfile:
        profile = super().profile(estimation, loaded, max_num_tokens, config, undo)
        sizes = graph_batch_sizes(config.max_batch_size, config.cuda_graph_batch_sizes)
        return dataclasses.replace(profile, graph_bytes=self.graph_bytes(sizes) if config.cuda_graphs else 0)

    def capture_graphs(self, loaded, resolved, final, plan, config, batch_sizes, undo) -> Warmup:
        nbytes = self.graph_bytes(batch_sizes)
        graphs = allocate(self.device, nbytes, "warmup/graphs", undo)
        return Warmup(graphs, tuple(batch_sizes), (8, 16), 2 * len(batch_sizes), nbytes, plan.graph_bytes, 0.01)

    def start_executor(self, loaded, resolved, final, plan, config, undo, warmup=None):
        self.started_with = warmup
        return super().start_executor(loaded, resolved, final, plan, config, undo)


def setup(**overrides):
    device, memory = sim_device("h100-80gb"), InMemorySpanExporter()
    backend = GraphSim(device)
    config = BootstrapConfig.parse(**{**LLAMA, **overrides})
    pipeline = make_pipeline(config, backend, tracer_provider=make_tracer_provider(memory=memory))
    return pipeline, backend, memory


def spans(memory, name):
    return [s for s in memory.get_finished_spans() if s.name == name]


def test_warmup_sits_between_final_build_and_scheduler_sampler():
    assert STAGE_IDS.index("warmup") == STAGE_IDS.index("final_build") + 1 == STAGE_IDS.index("scheduler_sampler") - 1


async def test_capture_is_measured_reserved_traced_and_handed_to_the_executor():
    pipeline, backend, memory = setup()
    artifacts = await pipeline.run()
    warmup, plan = artifacts["warmup"], artifacts["plan"]
    assert pipeline.status["warmup"].state == "done"
    assert warmup.batch_sizes == (1, 2, 4, 8, 16, 24, 32)
    assert plan.graph_bytes == artifacts["profile"].graph_bytes == warmup.graph_bytes == 56 * MiB
    assert backend.started_with is warmup
    (span,) = spans(memory, "bootstrap.stage.warmup")
    attributes = span.attributes
    assert attributes["bootstrap.outcome"] == "ok"
    assert attributes["bootstrap.warmup.graph_bytes"] == attributes["bootstrap.warmup.reserved_bytes"] == 56 * MiB
    assert list(attributes["bootstrap.warmup.batch_sizes"]) == [1, 2, 4, 8, 16, 24, 32]
    assert attributes["bootstrap.warmup.graphs"] == 14
    before, after = attributes["bootstrap.device.free_bytes.before"], attributes["bootstrap.device.free_bytes.after"]
    assert before - after == 56 * MiB
    await pipeline.aclose()
    assert backend.device.live() == {}

    off, _, _ = setup(cuda_graphs=False)
    off_artifacts = await off.run()
    assert off.status["warmup"].state == "skipped" and off_artifacts["plan"].graph_bytes == 0
    reserved = off_artifacts["plan"].kv_budget_bytes - plan.kv_budget_bytes
    assert reserved == pytest.approx(56 * MiB * 0.9, abs=1)  # the budget gives up the graphs' bytes
    await off.aclose()


async def test_oom_retries_with_the_smaller_half_of_the_batch_sizes_and_rolls_back():
    pipeline, backend, memory = setup()
    backend.device.inject_oom("warmup", 2)
    artifacts = await pipeline.run()
    assert artifacts["warmup"].batch_sizes == (1,)
    attempts = spans(memory, "bootstrap.stage.warmup.attempt")
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "ERROR", "OK"]
    assert attempts[1].attributes["bootstrap.adapt.cuda_graph_batch_sizes"] == "[1, 2, 4, 8, 16, 24, 32] -> [1, 2, 4]"
    assert attempts[2].attributes["bootstrap.adapt.cuda_graph_batch_sizes"] == "[1, 2, 4] -> [1]"
    assert backend.device.live()["warmup/graphs"] == 8 * MiB  # the failed attempts left nothing
    await pipeline.aclose()
    assert backend.device.live() == {}


async def test_oom_with_one_batch_size_left_fails_with_the_knob_and_keeps_the_pools_for_retry():
    pipeline, backend, _ = setup(cuda_graph_batch_sizes=(1,))
    backend.device.inject_oom("warmup", 1)
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    assert info.value.stage == "warmup" and "--no-cuda-graphs" in str(info.value)
    assert any(tag.startswith("final_build") for tag in backend.device.live())
    artifacts = await pipeline.retry()  # the fault is spent: captured this time, nothing reloaded
    assert artifacts["warmup"].batch_sizes == (1,)
    await pipeline.aclose()
    assert backend.device.live() == {}


def test_skip_reasons():
    gpu = GraphSim(sim_device("h100-80gb"))
    on, off = BootstrapConfig.parse(**LLAMA), BootstrapConfig.parse(**LLAMA, cuda_graphs=False)
    assert skip_warmup(on, gpu) is None
    assert skip_warmup(off, gpu).reason == "disabled"
    assert skip_warmup(on, SimBackend(sim_device("h100-80gb"))).reason == "unsupported"
    assert skip_warmup(BootstrapConfig.parse(**LLAMA, tensor_parallel_size=2), gpu) is None  # every rank captures

    class CpuBackend:
        device = type("Cpu", (), {"kind": "cpu"})()
        capture_graphs = None

    assert skip_warmup(on, CpuBackend()).reason == "cpu"


def test_the_plan_reserves_the_measured_graph_bytes():
    base = dict(
        total_bytes=100 * MiB * 1024,
        free_before_bytes=0,
        model_bytes=10 * 1024 * MiB,
        torch_peak_bytes=20 * 1024 * MiB,
        torch_used_bytes=15 * 1024 * MiB,
        used_bytes=16 * 1024 * MiB,
        probe_kv_bytes=4 * 1024 * MiB,
        max_num_tokens=2048,
    )
    args = dict(cost=CacheCost(131072), fraction=0.9, max_seq_len=8192, max_batch_size=32, tokens_per_block=32)
    without = plan_capacity(MemoryProfile(**base), **args)
    with_graphs = plan_capacity(MemoryProfile(**base, graph_bytes=512 * MiB), **args)
    assert without.kv_budget_bytes - with_graphs.kv_budget_bytes == int(512 * MiB * 0.9)
    assert with_graphs.graph_bytes == 512 * MiB and with_graphs.to_dict()["graph_bytes"] == 512 * MiB


def test_config_batch_sizes_are_checked_against_max_batch_size():
    from bootstrap.config import ConfigError

    assert BootstrapConfig.parse(max_batch_size=8, cuda_graph_batch_sizes=[4, 1, 4]).cuda_graph_batch_sizes == (1, 4)
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes"):
        BootstrapConfig.parse(max_batch_size=8, cuda_graph_batch_sizes=[16])
