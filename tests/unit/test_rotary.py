"""The engine's rotary embedding against transformers' own, scaling by scaling.

Each case is a config.json as a checkpoint ships it (``rope_scaling``, or transformers 5's
``rope_parameters``); transformers reads it through its config class and rotary embedding class,
the engine through ``Rotary`` as the decoder builds it. Frequencies, attention scaling and cos/sin
for positions past the pretraining length must be bit-identical.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from bootstrap.engine.layers.rotary import (
    SCALINGS,
    Rotary,
    apply_rotary,
    attention_scaling,
    inverse_frequencies,
    rope_scaling_problem,
    rope_type,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
    "qwen3": (Qwen3Config, Qwen3RotaryEmbedding),
}
LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
QWEN25_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
DEEPSEEK_YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
GPT_OSS_YARN = {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": False,
}


def config_json(
    model_type: str, head_dim: int, theta: float, scaling: dict[str, Any] | None, positions: int, **extra: Any
) -> dict[str, Any]:
    cfg = {
        "model_type": model_type,
        "hidden_size": 4 * head_dim,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": positions,
        "rope_theta": theta,
        "rope_scaling": scaling,
        **extra,
    }
    if model_type != "qwen2":  # Qwen2 derives head_dim from hidden_size / heads
        cfg["head_dim"] = head_dim
    return cfg


def as_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same config as transformers 5 writes it: theta inside ``rope_parameters``."""
    cfg = dict(cfg)
    scaling = cfg.pop("rope_scaling") or {"rope_type": "default"}
    cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta")}
    return cfg


CASES = {
    "default-llama": config_json("llama", 64, 10000.0, None, 2048),
    "default-qwen3": config_json("qwen3", 128, 1000000.0, None, 40960),
    "default-int-theta": config_json("llama", 64, 10000, None, 2048),
    "linear-2": config_json("llama", 64, 10000.0, {"type": "linear", "factor": 2.0}, 4096),
    "linear-4-int": config_json("qwen2", 128, 1000000.0, {"rope_type": "linear", "factor": 4}, 32768),
    "llama3.1": config_json("llama", 128, 500000.0, {**LLAMA31, "rope_type": "llama3"}, 131072),
    "llama3.2": config_json("llama", 64, 500000.0, {**LLAMA31, "factor": 32.0, "rope_type": "llama3"}, 131072),
    "llama3-top-level-original": config_json(
        "llama", 128, 500000.0, {**LLAMA31, "rope_type": "llama3"}, 131072, original_max_position_embeddings=4096
    ),
    "yarn-qwen2.5": config_json("qwen2", 128, 1000000.0, QWEN25_YARN, 32768),
    "yarn-qwen3": config_json(
        "qwen3", 128, 1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072
    ),
    "yarn-mscale-deepseek": config_json("llama", 64, 10000, DEEPSEEK_YARN, 163840),
    "yarn-mscale-ratio": config_json(
        "llama", 64, 10000.0, {**DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 0.8}, 163840
    ),
    "yarn-mscale-all-dim-zero": config_json(
        "llama", 64, 10000.0, {**DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 0}, 163840
    ),
    "yarn-attention-factor": config_json("qwen3", 128, 1000000.0, {**QWEN25_YARN, "attention_factor": 0.9}, 131072),
    "yarn-no-truncate": config_json("llama", 64, 150000.0, GPT_OSS_YARN, 131072),
    "yarn-betas": config_json("llama", 64, 10000.0, {**QWEN25_YARN, "beta_fast": 8, "beta_slow": 2}, 131072),
    "yarn-beta-zero": config_json("llama", 64, 10000.0, {**QWEN25_YARN, "beta_fast": 0, "beta_slow": 0}, 131072),
    "yarn-equal-range": config_json(
        "llama", 32, 10000.0, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}, 16
    ),
    "yarn-no-original": config_json("qwen2", 128, 1000000.0, {"type": "yarn", "factor": 4.0}, 32768),
    "yarn-factor-none": config_json("qwen2", 128, 1000000.0, {**QWEN25_YARN, "factor": None}, 131072),
    "yarn-top-level-original": config_json(
        "llama", 64, 10000.0, QWEN25_YARN, 131072, original_max_position_embeddings=8192
    ),
    "yarn-factor-below-one": config_json("llama", 64, 10000.0, {**QWEN25_YARN, "factor": 1.0}, 32768),
}
CASES.update({f"{name}-rope-parameters": as_rope_parameters(cfg) for name, cfg in list(CASES.items())})


def reference(cfg: dict[str, Any]) -> torch.nn.Module:
    """transformers' rotary embedding for this config.json (copied: transformers edits the dict)."""
    config_class, rotary_class = FAMILIES[cfg["model_type"]]
    return rotary_class(config_class.from_dict(copy.deepcopy(cfg)))


def engine_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """``Rotary``'s arguments as the decoder derives them from config.json."""
    params = cfg.get("rope_parameters") or {}
    return {
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "theta": float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0),
        "scaling": copy.deepcopy(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        "max_position_embeddings": cfg["max_position_embeddings"],
        "original_max_position_embeddings": cfg.get("original_max_position_embeddings"),
    }


def sample_positions(cfg: dict[str, Any]) -> torch.Tensor:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or 0
    limit = cfg["max_position_embeddings"]
    edges = [original - 2, original - 1, original, original + 1, limit - 1, limit, 2 * limit, 1_000_003]
    return torch.cat((torch.arange(0, 300), torch.arange(0, limit, max(1, limit // 500)), torch.tensor(edges))).clamp(
        min=0
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(name: str) -> None:
    cfg = CASES[name]
    ref = reference(cfg)
    kwargs = engine_kwargs(cfg)
    ours = Rotary(**kwargs)
    assert rope_scaling_problem(kwargs["scaling"]) is None

    kind = ref.rope_type
    assert kind == rope_type(kwargs["scaling"])
    init = ref.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scale = init(ref.config)
    assert ours.inv_freq.dtype == torch.float32
    assert torch.equal(ours.inv_freq, inv_freq)
    assert torch.equal(ours.inv_freq, ref.inv_freq)
    assert ours.attention_scaling == scale == ref.attention_scaling
    lengths = {k: kwargs[k] for k in ("max_position_embeddings", "original_max_position_embeddings")}
    assert attention_scaling(kwargs["scaling"], **lengths) == scale
    assert torch.equal(inverse_frequencies(kwargs["head_dim"], kwargs["theta"], kwargs["scaling"], **lengths), inv_freq)

    positions = sample_positions(cfg)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = ours(positions, dtype)
        ref_cos, ref_sin = ref(torch.zeros(1, dtype=dtype), positions[None])
        assert cos.shape == sin.shape == (positions.numel(), kwargs["head_dim"])
        assert cos.dtype == sin.dtype == dtype
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_yarn_cases_exercise_the_options() -> None:
    """The yarn cases above differ where the options say: attention scaling, ramp and fallback lengths."""

    def run(name: str) -> Rotary:
        return Rotary(**engine_kwargs(CASES[name]))

    assert run("yarn-qwen2.5").attention_scaling == 0.1 * math.log(4.0) + 1.0
    assert run("yarn-mscale-deepseek").attention_scaling == 1.0  # mscale == mscale_all_dim
    assert run("yarn-mscale-ratio").attention_scaling != 1.0
    assert run("yarn-mscale-all-dim-zero").attention_scaling == 0.1 * math.log(40) + 1.0  # from factor alone
    assert run("yarn-attention-factor").attention_scaling == 0.9
    assert run("yarn-factor-below-one").attention_scaling == 1.0
    assert not torch.equal(
        run("yarn-no-truncate").inv_freq,
        Rotary(**{**engine_kwargs(CASES["yarn-no-truncate"]), "scaling": {**GPT_OSS_YARN, "truncate": True}}).inv_freq,
    )
    default_betas = Rotary(**{**engine_kwargs(CASES["yarn-betas"]), "scaling": dict(QWEN25_YARN)})
    assert not torch.equal(run("yarn-betas").inv_freq, default_betas.inv_freq)
    assert torch.equal(run("yarn-beta-zero").inv_freq, default_betas.inv_freq)  # 0 falls back to 32 and 1
    # factor None: max_position_embeddings / original (131072 / 32768 = 4), as the explicit factor 4
    assert torch.equal(run("yarn-factor-none").inv_freq, Rotary(**engine_kwargs(CASES["yarn-qwen2.5"])).inv_freq)


def test_yarn_needs_a_length() -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        Rotary(64, 10000.0, {"type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Rotary(64, 10000.0, {"type": "yarn", "factor": None, "original_max_position_embeddings": 4096})
    # the decoder's call without the lengths keeps working where the scaling carries them
    assert Rotary(64, 10000.0, dict(QWEN25_YARN)).attention_scaling > 1.0
    assert torch.equal(Rotary(64, 10000.0, None).inv_freq, inverse_frequencies(64, 10000.0, None))


def test_reset_recomputes_the_same() -> None:
    rotary = Rotary(**engine_kwargs(CASES["yarn-mscale-ratio"]))
    before, scale = rotary.inv_freq.clone(), rotary.attention_scaling
    rotary.inv_freq = torch.empty_like(before, device="meta")
    rotary.reset(torch.device("cpu"))
    assert torch.equal(rotary.inv_freq, before) and rotary.attention_scaling == scale


def test_apply_rotary_matches_transformers() -> None:
    cfg = CASES["yarn-qwen2.5"]
    rotary = Rotary(**engine_kwargs(cfg))
    positions = torch.tensor([0, 1, 5, 32767, 32768, 100000])
    cos, sin = rotary(positions, torch.float32)
    q, k = torch.randn(positions.numel(), 4, 128), torch.randn(positions.numel(), 2, 128)
    ref_q, ref_k = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None], unsqueeze_dim=2)
    assert torch.equal(apply_rotary(q, cos, sin), ref_q[0]) and torch.equal(apply_rotary(k, cos, sin), ref_k[0])


@pytest.mark.parametrize(
    ("scaling", "words"),
    [
        ({"type": "dynamic", "factor": 2.0}, ["'dynamic'", "longest sequence", "implemented: default"]),
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, ["'dynamic'", "batch"]),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, ["'longrope'", "batch"]),
        ({"rope_type": "proportional", "partial_rotary_factor": 0.25}, ["'proportional'", "yarn"]),
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, ["'mrope'"]),
        ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, ["partial_rotary_factor 0.5"]),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}, ["partial_rotary_factor"]),
        ({"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}, ["per layer"]),
    ],
)
def test_problem_names_what_is_not_implemented(scaling: dict[str, Any], words: list[str]) -> None:
    problem = rope_scaling_problem(scaling)
    assert problem is not None
    for word in words:
        assert word in problem


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {},
        {"rope_type": "default", "rope_theta": 1e6},
        {"type": "linear", "factor": 2.0},
        dict(QWEN25_YARN),
        {**LLAMA31, "rope_type": "llama3", "partial_rotary_factor": 1.0},
    ],
)
def test_no_problem_for_implemented(scaling: dict[str, Any] | None) -> None:
    assert rope_scaling_problem(scaling) is None
    assert SCALINGS == ("default", "linear", "llama3", "yarn")


def test_dynamic_is_batch_dependent_in_transformers() -> None:
    """Why ``dynamic`` stays refused: past max_position_embeddings the same position gets other
    frequencies when a longer sequence shares the forward (below it, it is the default rope)."""
    cfg = config_json("llama", 64, 10000.0, {"type": "dynamic", "factor": 2.0}, 64)
    x = torch.zeros(1)
    alone = reference(cfg)(x, torch.arange(101)[None])[0][0, 100]
    batched = reference(cfg)(x, torch.stack((torch.arange(101), torch.arange(100, 201))))[0][0, 100]
    assert not torch.equal(alone, batched)
    short = reference(cfg)(x, torch.arange(64)[None])[0][0]
    assert torch.equal(short, Rotary(64, 10000.0, None)(torch.arange(64), torch.float32)[0])
