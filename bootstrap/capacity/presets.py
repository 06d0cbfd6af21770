"""Real ``config.json`` contents of well-known models, and `resolve_model_shape`.

Each preset is the published config.json of the named Hugging Face checkpoint, as quoted in
public repositories (each preset's source is the comment above it). Where only part of a file
could be verified, the preset keeps the verified fields, which include every field that
determines the shape; token ids and training-only keys are then left out rather than guessed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from bootstrap.capacity.config_json import parse_config, shape_from_path
from bootstrap.capacity.shape import ModelConfigError, ModelShape

_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

_PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B(-Instruct) config.json (citsjtu2020/LLM-Prof sglang/Model_Config.md)
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": dict(_LLAMA31_ROPE),
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # meta-llama/Llama-3.1-70B-Instruct: 80 layers, 64/8 heads, 8192 / 28672, vocab 128256, 131072 positions, bf16
    # (several model tables); rope_scaling as every Llama-3.1 checkpoint
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": dict(_LLAMA31_ROPE),
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    # Qwen/Qwen2.5-7B config.json (LLM-Prof, as above)
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    # mistralai/Mistral-7B-v0.3 (vocab 32768, 32 layers, 32/8 heads, 14336, rope_theta 1e6, no sliding
    # window; litgpt configs and Mistral v0.3 config excerpts)
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 32768,
    },
    # deepseek-ai/DeepSeek-V2-Lite config.json (a C++ test quoting it verbatim)
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
    # mistralai/Mixtral-8x7B-v0.1 config.json (TensorRT-LLM test_mixtral.py and others)
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    # Qwen/Qwen3-8B config.json (LLM-Prof, as above)
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # google/gemma-2-9b config.json (a KQI benchmark script quoting Hub configs)
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 16,
        "num_hidden_layers": 42,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "sliding_window_size": 4096,
        "torch_dtype": "float32",
        "transformers_version": "4.42.0.dev0",
        "use_cache": True,
        "vocab_size": 256000,
    },
    # meta-llama/Llama-3.2-1B(-Instruct) config.json (kevinstephano/thunder_model_blocks
    # hf_llama/llama_config.py, quoting the Hub file with its commit hash)
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # Qwen/Qwen2.5-14B config.json (LLM-Prof, as above)
    "qwen2.5-14b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 13824,
        "max_position_embeddings": 131072,
        "max_window_layers": 48,
        "model_type": "qwen2",
        "num_attention_heads": 40,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    # HuggingFaceTB/SmolLM2-135M(-Instruct) LlamaConfig dump (same architecture)
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536,
        "is_llama_config": True,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 49152,
    },
}

_ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "mistral-7b-v0.3": "mistral-7b"}

MODEL_PRESETS: dict[str, dict[str, Any]] = _PRESETS
"""Preset name -> config.json. Treat as read-only; `preset_config` hands out deep copies."""

RANDOM_PREFIX = "random:"


def preset_names() -> list[str]:
    return sorted([*_PRESETS, *_ALIASES])


def preset_config(name: str) -> dict[str, Any]:
    """A deep copy of the preset's config.json (aliases accepted)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
    return copy.deepcopy(_PRESETS[key])


def preset_shape(name: str) -> ModelShape:
    return parse_config(preset_config(name))


def resolve_model_shape(spec: str) -> ModelShape:
    """Shape for a preset name, ``random:<preset or config.json>``, a config.json or a checkpoint dir.

    A GGUF file is not resolved here (reading its metadata needs the engine's loader).
    """
    target = spec[len(RANDOM_PREFIX) :] if spec.startswith(RANDOM_PREFIX) else spec
    if target.lower() in _PRESETS or target.lower() in _ALIASES:
        return preset_shape(target)
    path = Path(target).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        return shape_from_path(path)
    raise ModelConfigError(
        f"model {spec!r} is neither a preset nor a config.json / checkpoint directory; "
        f"presets: {', '.join(preset_names())}"
    )
