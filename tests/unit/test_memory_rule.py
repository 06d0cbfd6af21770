"""The memory rule (``bootstrap.capacity.rules``): resolved once in ``resolve_classes``, applied by
the probe cap and the plan alike, recorded on the capacity span; and the native engine's headroom.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.backends.native.headroom import WORKSPACE_BYTES, headroom_terms
from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity import MemoryProfile
from bootstrap.capacity.rules import DEFAULT_FRACTION
from bootstrap.config import BootstrapConfig
from bootstrap.devices import CpuDevice
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages.estimation_build import capped_probe_tokens
from bootstrap.stages.resolve_classes import resolve_classes

GB = 10**9
PROFILE = MemoryProfile(
    total_bytes=150 * GB,
    free_before_bytes=130 * GB,
    model_bytes=16 * GB,
    torch_peak_bytes=19 * GB,
    torch_used_bytes=18 * GB,
    used_bytes=19 * GB,
    probe_kv_bytes=2 * GB,
    max_num_tokens=8192,
)


class HeadroomSim(SimBackend):
    """The simulated GPU with a default headroom, as the native engine has on CUDA: 2 GB known
    before profiling, 3 GB once the profile is measured."""

    def default_headroom_bytes(self, profile, resolved, config):
        return 3 * GB if profile is not None else 2 * GB


def config(**values) -> BootstrapConfig:
    return BootstrapConfig(**{"model": "llama-3.1-8b", "max_seq_len": 8192, "max_num_tokens": 8192, **values})


@pytest.mark.parametrize(
    "values, source, fraction, headroom",
    [
        ({}, "backend_headroom", DEFAULT_FRACTION, 2 * GB),  # neither given: the backend's, before profiling
        ({"free_gpu_memory_fraction": 0.9}, "free_gpu_memory_fraction", 0.9, None),  # given at the default value
        ({"free_gpu_memory_fraction": 0.95}, "free_gpu_memory_fraction", 0.95, None),
        ({"kv_headroom_bytes": 5 * GB}, "kv_headroom_bytes", DEFAULT_FRACTION, 5 * GB),
        ({"kv_headroom_bytes": 0}, "kv_headroom_bytes", DEFAULT_FRACTION, 0),
    ],
)
def test_the_rule_is_resolved_once_from_what_the_config_gives(values, source, fraction, headroom):
    rule = resolve_classes(config(**values), HeadroomSim(sim_device("h200"))).memory_rule
    assert (rule.source, rule.fraction, rule.headroom_bytes) == (source, fraction, headroom)


def test_without_a_backend_headroom_the_default_fraction_applies():
    backend, cfg = SimBackend(sim_device("h200")), config()
    rule = resolve_classes(cfg, backend).memory_rule
    assert (rule.source, rule.fraction, rule.headroom_bytes) == ("default_fraction", 0.9, None)
    assert rule.share(100 * GB) == 90 * GB


def test_the_probe_cap_applies_the_same_rule():
    """49,152 probe tokens of the 8B shape (6.4 GB) wanted in 6 GiB: the backend's 2 GB headroom
    and the fraction cap it to different sizes, each by its own formula."""
    cfg = config(max_num_tokens=49152, max_seq_len=49152)
    for backend, share in (
        (HeadroomSim(sim_device("6GiB")), lambda room: room - 2 * GB),
        (SimBackend(sim_device("6GiB")), lambda room: int(room * 0.9)),
    ):
        resolved = resolve_classes(cfg, backend)
        room = backend.device.free_bytes() - backend.estimation_overhead_bytes(resolved, cfg)
        per_token = resolved.probe_cost(tp=1, max_batch_size=cfg.max_batch_size).slope
        expected = share(room) // per_token // cfg.tokens_per_block * cfg.tokens_per_block
        assert capped_probe_tokens(cfg, resolved, backend, 49152) == expected < 49152


def test_capacity_recomputes_the_backend_headroom_and_records_the_rule_on_its_span():
    memory = InMemorySpanExporter()
    provider = make_tracer_provider(memory=memory)
    pipeline = make_pipeline(config(), HeadroomSim(sim_device("h200")), tracer_provider=provider)
    anyio.run(pipeline.run)
    plan = pipeline.artifacts["plan"]
    anyio.run(pipeline.aclose)
    assert (plan.headroom_bytes, plan.rule_source) == (3 * GB, "backend_headroom")  # from the profile
    (span,) = [s for s in memory.get_finished_spans() if s.name == "bootstrap.stage.capacity"]
    assert span.attributes["bootstrap.memory_rule"] == "the backend's headroom of 3,000,000,000 bytes (no rule given)"
    assert span.attributes["bootstrap.memory_rule.source"] == "backend_headroom"


def test_the_native_headroom_terms_for_an_8b_shape():
    backend, cfg = SimBackend(sim_device("h200")), config()
    resolved = resolve_classes(cfg, backend)
    assert (resolved.dtype, resolved.shape.num_layers, resolved.cost.slope) == ("bfloat16", 32, 131072)
    terms = headroom_terms(PROFILE, resolved, cfg)
    assert terms == {
        "activation": PROFILE.activation_bytes,  # the measured peak once more
        "continued_chunk": 8192 * 4096 + 8192 * 8192 * 5,  # one layer's context gathered; mask and bias
        "workspace": WORKSPACE_BYTES,
        "total": PROFILE.activation_bytes + 8192 * 4096 + 8192 * 8192 * 5 + WORKSPACE_BYTES,
    }
    bigger = dataclasses.replace(PROFILE, torch_peak_bytes=20 * GB)  # a larger measured activation peak
    assert headroom_terms(bigger, resolved, cfg)["activation"] == terms["activation"] + GB
    # sliding windows: the masked call repeats the gathered layer for the 32 query heads
    windowed = dataclasses.replace(resolved, shape=dataclasses.replace(resolved.shape, layer_windows=(4096,) * 32))
    repeated = headroom_terms(PROFILE, windowed, cfg)["continued_chunk"] - terms["continued_chunk"]
    assert repeated == 8192 * 2 * 32 * 128 * 2


def test_the_native_engine_has_no_default_headroom_on_the_cpu():
    backend, cfg = NativeBackend(CpuDevice(), torch.device("cpu")), config()
    assert backend.default_headroom_bytes(PROFILE, resolve_classes(cfg, SimBackend(sim_device("h200"))), cfg) is None


def test_the_cli_gives_the_fraction_only_when_the_flag_is_given():
    from bootstrap.cli.args import config_from_args
    from bootstrap.cli.main import build_parser

    parse = build_parser().parse_args
    plain = config_from_args(parse(["plan", "--model", "llama-3.1-8b", "--gpu", "h200"]))
    given = config_from_args(
        parse(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--free-gpu-memory-fraction", "0.9"])
    )
    headroom = config_from_args(
        parse(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--kv-headroom-bytes", "4096"])
    )
    assert plain.free_gpu_memory_fraction is None and given.free_gpu_memory_fraction == 0.9
    assert headroom.kv_headroom_bytes == 4096
    backend = HeadroomSim(sim_device("h200"))
    rules = [resolve_classes(c, backend).memory_rule.source for c in (plain, given, headroom)]
    assert rules == ["backend_headroom", "free_gpu_memory_fraction", "kv_headroom_bytes"]
