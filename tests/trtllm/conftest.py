"""Fixtures for the trtllm backend tests: a fake TensorRT-LLM installation per version."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_trtllm import FakeTrtllm
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.sim_gpus import sim_device
from bootstrap.backends.trtllm import TrtllmBackend
from bootstrap.config import BootstrapConfig
from bootstrap.devices import FakeDevice
from bootstrap.pipeline import Pipeline
from bootstrap.pipeline.telemetry import make_tracer_provider

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


@pytest.fixture(params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def draft_config(tmp_path: Path) -> Path:
    """A 1B-class Llama draft sharing Llama 3's vocabulary (a Llama-3.2-1B-shaped config.json)."""
    path = tmp_path / "draft" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    return path
