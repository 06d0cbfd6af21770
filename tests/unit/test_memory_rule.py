"""Which memory rule the capacity stage applies, and the native engine's default headroom.

``kv_headroom_bytes`` when given; TensorRT-LLM's fraction when ``free_gpu_memory_fraction`` is
given (its semantics behind its own field); else the backend's default headroom, where it has one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bootstrap.backends.native import NativeBackend
from bootstrap.backends.native_headroom import WORKSPACE_BYTES, headroom_terms
from bootstrap.backends.sim import SimBackend
from bootstrap.backends.sim_gpus import sim_device
from bootstrap.capacity import MemoryProfile, plan_capacity
from bootstrap.config import BootstrapConfig
from bootstrap.devices import CpuDevice
from bootstrap.stages.capacity import memory_rule
from bootstrap.stages.resolve_classes import resolve_classes

GB = 10**9
PROFILE = MemoryProfile(
    total_bytes=150 * GB, free_before_bytes=130 * GB, model_bytes=16 * GB, torch_peak_bytes=19 * GB,
    torch_used_bytes=18 * GB, used_bytes=19 * GB, probe_kv_bytes=2 * GB, max_num_tokens=8192,
)  # fmt: skip


class HeadroomSim(SimBackend):
    """The simulated GPU with a default headroom, as the native engine has on CUDA."""

    def default_headroom_bytes(self, profile, resolved, config):
        return 3 * GB


def config(**values) -> BootstrapConfig:
    return BootstrapConfig(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, **values)


@pytest.mark.parametrize(
    "values, expected",
    [
        ({}, 3 * GB),  # neither given: the backend's default
        ({"free_gpu_memory_fraction": 0.9}, None),  # given, even at its default value: TensorRT-LLM's rule
        ({"free_gpu_memory_fraction": 0.95}, None),
        ({"kv_headroom_bytes": 5 * GB}, 5 * GB),
        ({"kv_headroom_bytes": 0}, 0),
    ],
)
def test_the_rule_follows_what_the_config_gives(values, expected):
    backend = HeadroomSim(sim_device("h200"))
    cfg = config(**values)
    assert memory_rule(cfg, resolve_classes(cfg, backend), PROFILE, backend) == expected


def test_without_a_backend_default_the_fraction_applies():
    backend, cfg = SimBackend(sim_device("h200")), config()
    resolved = resolve_classes(cfg, backend)
    assert memory_rule(cfg, resolved, PROFILE, backend) is None
    plan = plan_capacity(PROFILE, cost=resolved.total_cost, fraction=cfg.free_gpu_memory_fraction,
                         max_seq_len=8192, max_batch_size=32, tokens_per_block=32)  # fmt: skip
    assert plan.kv_budget_bytes == int((150 - 19 - 1 + 2) * GB * 0.9)  # peak = torch peak + 1 GB outside torch


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


def test_the_native_engine_has_no_default_headroom_on_the_cpu():
    backend, cfg = NativeBackend(CpuDevice(), torch.device("cpu")), config()
    assert backend.default_headroom_bytes(PROFILE, resolve_classes(cfg, SimBackend(sim_device("h200"))), cfg) is None


def test_the_cli_gives_the_fraction_only_when_the_flag_is_given():
    from bootstrap.cli.args import config_from_args
    from bootstrap.cli.main import build_parser

    parse = build_parser().parse_args
    plain = config_from_args(parse(["plan", "--model", "llama-3.1-8b", "--gpu", "h200"]))
    given = config_from_args(parse(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--free-gpu-memory-fraction", "0.9"]))
    headroom = config_from_args(parse(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--kv-headroom-bytes", "4096"]))
    assert "free_gpu_memory_fraction" not in plain.model_fields_set and plain.free_gpu_memory_fraction == 0.9
    assert "free_gpu_memory_fraction" in given.model_fields_set
    assert headroom.kv_headroom_bytes == 4096
    backend = HeadroomSim(sim_device("h200"))
    rules = [memory_rule(c, resolve_classes(c, backend), PROFILE, backend) for c in (plain, given, headroom)]
    assert rules == [3 * GB, None, 4096]
