"""The trtllm backend on a fake TensorRT-LLM installation (``helpers.fake_trtllm``) per version:
``make_setup`` builds the pipeline, device and fake together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.backends.trtllm import TrtllmBackend
from bootstrap.config import BootstrapConfig
from bootstrap.devices import FakeDevice
from bootstrap.pipeline import Pipeline
from bootstrap.pipeline.telemetry import make_tracer_provider
from helpers.fake_trtllm import FakeTrtllm

VERSIONS = ("1.2.1", "main")
LLAMA = dict(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64, backend="trtllm")


@dataclass
class Setup:
    pipeline: Pipeline
    device: FakeDevice
    memory: InMemorySpanExporter
    fake: FakeTrtllm
    backend: TrtllmBackend
    config: BootstrapConfig

    def spans(self, name: str) -> list[Any]:
        return [s for s in self.memory.get_finished_spans() if s.name == name]


def make_setup(version: str = "main", gpu: str = "h100-80gb", llm_args: Any = None, **overrides: Any) -> Setup:
    device = sim_device(gpu)
    fake = FakeTrtllm(device, version)
    backend = TrtllmBackend(device, import_module=fake.import_module, llm_args=llm_args)
    config = BootstrapConfig.parse(**{**LLAMA, **overrides})
    memory = InMemorySpanExporter()
    pipeline = make_pipeline(config, backend, tracer_provider=make_tracer_provider(memory=memory))
    return Setup(pipeline, device, memory, fake, backend, config)
