"""ModelShape parsing, parameter counts and presets.

Published parameter counts check the presets; tiny random configs of each family check
`parameter_count` against the modules transformers actually builds.
"""

from __future__ import annotations

import json

import pytest

from bootstrap.capacity.config_json import parse_config, shape_from_path
from bootstrap.capacity.presets import MODEL_PRESETS, preset_config, preset_names, preset_shape, resolve_model_shape
from bootstrap.capacity.shape import ModelConfigError

# Parameter counts the model cards / Hub safetensors metadata publish.
PUBLISHED = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
    "mixtral-8x7b": 46_702_792_704,
    "deepseek-v2-lite": 15_706_484_224,
    "gemma-2-9b": 9_241_705_984,
    "smollm2-135m": 134_515_008,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-14b": 14_770_033_664,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    assert preset_shape(name).parameter_count() == PUBLISHED[name]


def test_llama_fields_and_defaults():
    shape = preset_shape("llama-3.1-8b")
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (32, 32, 8, 128)
    assert shape.attention_kind == "gqa" and not shape.tie_word_embeddings
    assert shape.layer_windows == (None,) * 32 and shape.num_recurrent_layers == 0
    assert shape.weight_bytes(2) == 2 * 8_030_261_248
    assert preset_shape("smollm2-135m").tie_word_embeddings


def test_attention_kinds():
    cfg = preset_config("llama-3.1-8b")
    assert parse_config({**cfg, "num_key_value_heads": 32}).attention_kind == "mha"
    assert parse_config({**cfg, "num_key_value_heads": 1}).attention_kind == "mqa"
    assert preset_shape("deepseek-v2-lite").attention_kind == "mla"


def test_gemma2_alternates_windows():
    shape = preset_shape("gemma-2-9b")
    assert shape.layer_windows[:4] == (4096, None, 4096, None)
    assert shape.attention_windows.count(None) == 21 and shape.tie_word_embeddings


def test_layer_types_set_the_windows():
    cfg = {
        **preset_config("qwen3-8b"),
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    }
    assert parse_config(cfg).layer_windows[:2] == (1024, None)


def test_qwen_windows_need_use_sliding_window():
    cfg = {**preset_config("qwen2.5-7b"), "sliding_window": 4096, "max_window_layers": 20}
    assert set(parse_config(cfg).layer_windows) == {None}
    windows = parse_config({**cfg, "use_sliding_window": True}).layer_windows
    assert windows[19] is None and windows[20] == 4096


def test_window_longer_than_context_is_full_attention():
    cfg = {**preset_config("mistral-7b"), "sliding_window": 32768}
    assert set(parse_config(cfg).layer_windows) == {None}
    assert set(parse_config({**cfg, "sliding_window": 4096}).layer_windows) == {4096}


def test_deepseek_moe_layout():
    shape = preset_shape("deepseek-v2-lite")
    assert shape.moe_layers[0] is False and all(shape.moe_layers[1:])
    assert (shape.num_experts, shape.num_shared_experts, shape.shared_expert_intermediate_size) == (64, 2, 2816)
    assert (shape.kv_lora_rank, shape.q_lora_rank, shape.qk_rope_head_dim) == (512, None, 64)


def test_jamba_layers_and_state():
    cfg = {
        "model_type": "jamba",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    shape = parse_config(cfg)
    assert shape.layer_kinds[4] == "attention" and shape.layer_kinds[12] == "attention"
    assert shape.num_recurrent_layers == 14 and shape.moe_layers[1] and not shape.moe_layers[0]
    assert shape.recurrent_state_bytes(2) == 14 * (128 * 3 + 128 * 16) * 2


def test_fingerprint_is_stable_and_sensitive():
    cfg = preset_config("qwen3-8b")
    reordered = dict(reversed(list(cfg.items())))
    assert parse_config(reordered).fingerprint() == preset_shape("qwen3-8b").fingerprint()
    assert parse_config({**cfg, "num_hidden_layers": 35}).fingerprint() != preset_shape("qwen3-8b").fingerprint()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "bert"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers"),
        ({"num_key_value_heads": 7}, "num_key_value_heads"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_bad_configs_name_the_field_and_model_type(change, field):
    cfg = {**preset_config("llama-3.1-8b"), **change}
    with pytest.raises(ModelConfigError, match=field) as err:
        parse_config(cfg)
    assert ("llama" in str(err.value)) or field == "model_type"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"layer_types": ["full_attention"] * 31 + ["chunked_attention"]},
            "field 'layer_types' has 'chunked_attention'; allowed: full_attention, sliding_attention",
        ),
        ({"layer_types": ["full_attention"] * 31 + [None]}, "field 'layer_types' has None; allowed"),
        ({"torch_dtype": 16}, "field 'torch_dtype' must be one of float32, float16, bfloat16, float64, got 16"),
        ({"torch_dtype": ["bfloat16"]}, "field 'torch_dtype' must be one of"),
        ({"torch_dtype": "int4"}, "got 'int4'"),
    ],
)
def test_unknown_layer_types_and_dtypes_are_rejected_not_ignored(change, message):
    with pytest.raises(ModelConfigError) as err:
        parse_config({**preset_config("llama-3.1-8b"), **change})
    assert str(err.value).startswith("llama config.json: ") and message in str(err.value)


def test_the_newer_dtype_key_is_read_and_checked_too():
    cfg = {k: v for k, v in preset_config("llama-3.1-8b").items() if k != "torch_dtype"}
    assert parse_config({**cfg, "dtype": "float16"}).torch_dtype == "float16"
    with pytest.raises(ModelConfigError, match="field 'dtype' must be one of"):
        parse_config({**cfg, "dtype": True})


def test_from_path_and_resolve(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("smollm2-135m")))
    assert shape_from_path(tmp_path) == preset_shape("smollm2-135m")
    assert resolve_model_shape(str(tmp_path / "config.json")) == preset_shape("smollm2-135m")
    assert resolve_model_shape(f"random:{tmp_path}") == preset_shape("smollm2-135m")
    assert resolve_model_shape("random:gemma-2-9b") == preset_shape("gemma-2-9b")
    assert resolve_model_shape("smollm2-135m-instruct") == preset_shape("smollm2-135m")
    with pytest.raises(ModelConfigError, match=r"llama-3\.1-8b"):
        resolve_model_shape("no-such-model")
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        shape_from_path(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        shape_from_path(tmp_path / "bad.json")


def test_preset_config_is_a_copy():
    preset_config("llama-3.1-8b")["rope_scaling"]["factor"] = 1.0
    assert MODEL_PRESETS["llama-3.1-8b"]["rope_scaling"]["factor"] == 8.0
    assert set(PUBLISHED) <= set(preset_names())


# --- against the modules transformers builds ---------------------------------------------------

_TINY = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

TINY_CONFIGS = {
    "llama": {**_TINY, "attention_bias": True, "mlp_bias": True},
    "mistral": {**_TINY, "sliding_window": 64},
    "qwen2": _TINY,
    "qwen3": {**_TINY, "head_dim": 32},
    "gemma": {**_TINY, "head_dim": 16},
    "gemma2": {**_TINY, "head_dim": 16, "sliding_window": 64},
    "mixtral": {**_TINY, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v2": {
        **_TINY,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "first_k_dense_replace": 1,
    },
    "jamba": {**_TINY, "num_hidden_layers": 8, "num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_parameter_count_matches_transformers(model_type):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cfg = {"model_type": model_type, **TINY_CONFIGS[model_type]}
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    saved = config.to_dict()
    assert parse_config(saved).parameter_count() == expected


def test_absurd_layer_counts_are_rejected_before_building_per_layer_tuples():
    cfg = {**preset_config("llama-3.1-8b"), "num_hidden_layers": 10**12}
    with pytest.raises(ModelConfigError, match=r"num_hidden_layers.*must be an integer in"):
        parse_config(cfg)


@pytest.mark.parametrize(
    ("config", "named", "quoted"),
    [
        (
            {"model_type": "password: hunter2 " * 100},
            "field 'model_type' must be one of",
            "a string of 1800 characters",
        ),
        ({"model_type": "gpt2"}, "field 'model_type' must be one of", "got 'gpt2'"),
        ({"model_type": "llama", "rms_norm_eps": "hunter2 secret"}, "'rms_norm_eps'", "a string of 14 characters"),
        ({"model_type": ["x"] * 9}, "field 'model_type' must be one of", "an array of 9 items"),
    ],
)
def test_a_config_value_is_quoted_only_when_short_and_token_like(config, named, quoted):
    """A value read from a file is the file's content: a short token as it is, else its kind and size."""
    with pytest.raises(ModelConfigError) as info:
        parse_config({**config})
    message = str(info.value)
    assert named in message and quoted in message and "hunter2" not in message, message
