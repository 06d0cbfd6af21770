"""FP8 weights as the plan prices them (``capacity.quantization``): both layouts of a config.json
read, their projections at 1 byte plus scales, what ``ignore`` names and everything else at 16
bits; a layout that cannot be priced refused naming the field; the native engine refuses to load
what it does not load, in ``resolve_classes``."""

from __future__ import annotations

import math

import pytest
from helpers.fp8_checkpoints import CHANNEL

from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.presets import MODEL_PRESETS
from bootstrap.capacity.shape import ModelConfigError

LLAMA = dict(MODEL_PRESETS["llama-3.1-8b"])
BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def shape(quantization=None, base=LLAMA):
    return parse_config({**base, "quantization_config": quantization} if quantization else dict(base))


def test_the_8b_in_both_layouts_is_priced_at_one_byte_a_projection_weight_plus_scales():
    plain = shape()
    h, layers, inner = plain.hidden_size, plain.num_layers, plain.intermediate_size
    q, kv = plain.num_heads * plain.head_dim, plain.num_kv_heads * plain.head_dim
    projections = layers * (2 * h * q + 2 * h * kv + 3 * h * inner)
    assert sum(r * c for _, r, c in plain.projections()) == projections
    rows = layers * (q + 2 * kv + h + 2 * inner + h)  # one channel scale per output row
    assert shape(CHANNEL).weight_bytes(2) == plain.weight_bytes(2) - projections + 4 * rows
    matrices = [(q, h), (kv, h), (kv, h), (h, q), (inner, h), (inner, h), (h, inner)]
    blocks = layers * sum(math.ceil(r / 128) * math.ceil(c / 128) for r, c in matrices)
    assert shape(BLOCK).weight_bytes(2) == plain.weight_bytes(2) - projections + 4 * blocks
    assert 9.0e9 < shape(CHANNEL).weight_bytes(2) < 9.2e9  # the published FP8 8B: 9.08 GB
    assert shape(CHANNEL).fingerprint() != plain.fingerprint() != shape(BLOCK).fingerprint()


def test_ignored_modules_stay_in_16_bits_and_other_methods_are_not_priced_lower():
    one_layer = {**CHANNEL, "ignore": ["lm_head", "re:model\\.layers\\.0\\..*"]}
    down = {**CHANNEL, "ignore": ["model.layers.3.mlp.down_proj"]}
    plain, channel = shape(), shape(CHANNEL)
    layer0 = sum(r * c for m, r, c in plain.projections() if m.startswith("model.layers.0."))
    rows0 = sum(r for m, r, c in plain.projections() if m.startswith("model.layers.0."))
    assert shape(one_layer).weight_bytes(2) == channel.weight_bytes(2) + layer0 - 4 * rows0
    assert (
        shape(down).weight_bytes(2)
        == channel.weight_bytes(2) + plain.hidden_size * plain.intermediate_size - 4 * plain.hidden_size
    )
    for other in ({"quant_method": "awq", "bits": 4}, {"quant_method": "gptq"}):
        assert shape(other).weight_bytes(2) == plain.weight_bytes(2) and not shape(other).quantization.fp8


def test_experts_and_latent_attention_are_priced_too():
    for preset in ("mixtral-8x7b", "deepseek-v2-lite"):
        plain = shape(base=dict(MODEL_PRESETS[preset]))
        matrices = sum(r * c for _, r, c in plain.projections())
        assert 0.9 * plain.parameter_count() < matrices < plain.parameter_count()
        priced = shape(BLOCK, base=dict(MODEL_PRESETS[preset])).weight_bytes(2)
        assert plain.weight_bytes(2) - matrices < priced < plain.weight_bytes(2) - 0.9 * matrices


@pytest.mark.parametrize(
    ("quantization", "field"),
    [
        ({**CHANNEL, "format": "pack-quantized"}, "quantization_config.format"),
        (
            {**CHANNEL, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
            "quantization_config.config_groups",
        ),
        ({**BLOCK, "weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({**BLOCK, "activation_scheme": "per-head"}, "quantization_config.activation_scheme"),
        ({**CHANNEL, "ignore": "lm_head"}, "quantization_config.ignore"),
        ({"bits": 8}, "quantization_config"),
    ],
)
def test_a_layout_that_cannot_be_priced_is_refused_naming_its_field(quantization, field):
    with pytest.raises(ModelConfigError, match=field.replace(".", r"\.")):
        shape(quantization)


@pytest.mark.parametrize(
    ("quantization", "tp", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, 1, "quant_method 'awq'"),
        ({**BLOCK, "activation_scheme": "static"}, 1, "static activation scales"),
        ({**BLOCK, "weight_block_size": [96, 128]}, 1, r"weight_block_size: \[96, 128\] does not divide the q_proj"),
        ({**BLOCK, "weight_block_size": [128, 384]}, 2, "does not divide the o_proj columns .4096 over 2"),
        ({**BLOCK, "weight_block_size": [128, 128]}, 16, "does not divide the k_proj and v_proj rows .1024 over 16"),
    ],
)
def test_the_native_engine_refuses_what_it_does_not_run_in_resolve_classes(quantization, tp, named):
    import torch

    from bootstrap.backends.native.checks import check_quantization
    from bootstrap.config import ConfigError

    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=named):
        check_quantization(shape(quantization), cpu, tp)
    check_quantization(shape(CHANNEL), cpu, 8)
    check_quantization(shape(BLOCK), cpu, 8)


def test_quantization_fp8_prices_a_16_bit_checkpoint_as_fp8_and_keeps_an_fp8_one():
    from bootstrap.backends.sim.backend import SimBackend
    from bootstrap.backends.sim.gpus import sim_device
    from bootstrap.capacity.quantization import AT_LOAD
    from bootstrap.config import BootstrapConfig
    from bootstrap.stages.resolve_classes import quantized_at_load, resolve_classes

    backend = SimBackend(sim_device("h200"))
    plain = resolve_classes(BootstrapConfig(model="llama-3.1-8b"), backend).shape
    at_load = resolve_classes(BootstrapConfig(model="llama-3.1-8b", quantization="fp8"), backend).shape
    assert plain.quantization is None and at_load.quantization is AT_LOAD
    assert at_load.weight_bytes(2) == shape(CHANNEL).weight_bytes(2) < plain.weight_bytes(2)
    assert at_load.fingerprint() != plain.fingerprint()
    config = BootstrapConfig(model="llama-3.1-8b", quantization="fp8")
    assert quantized_at_load(shape(BLOCK), config) == shape(BLOCK)  # an FP8 checkpoint loads as it is


def test_quantization_fp8_refuses_a_checkpoint_quantized_otherwise():
    from bootstrap.config import BootstrapConfig, ConfigError
    from bootstrap.stages.resolve_classes import quantized_at_load

    with pytest.raises(ConfigError, match="quantization: fp8 for a checkpoint quantized with 'awq'"):
        quantized_at_load(shape({"quant_method": "awq", "bits": 4}), BootstrapConfig(quantization="fp8"))
