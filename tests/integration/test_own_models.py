"""The engine's own model code (``bootstrap.engine.models``) against transformers, the reference.

Each case is a tiny seeded checkpoint directory written by transformers (safetensors, float32):
the engine loads it into its own decoder (fused q/k/v and gate/up, its own norms and rotary
embeddings, paged attention called directly) and must give transformers' last-position logits
within 1e-4 and its 64 greedy tokens exactly. Configs it does not implement stay on the
transformers path.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers.tiny_models import SHAPE
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from bootstrap.capacity.presets import MODEL_PRESETS
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor, load_model
from bootstrap.engine.models import FAMILIES, load_own_model, own_model_problem
from bootstrap.engine.models.decoder import DecoderLM
from bootstrap.engine.request.sequence import Sequence, next_request_id

CPU = torch.device("cpu")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "llama-llama3-rope": lambda: LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "llama-linear-rope": lambda: LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2-yarn-rope": lambda: Qwen2Config(
        **SHAPE, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ),
    "qwen3-yarn-rope-mscale": lambda: Qwen3Config(
        **SHAPE,
        head_dim=32,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "llama-attention-bias-tied": lambda: LlamaConfig(**SHAPE, attention_bias=True, tie_word_embeddings=True),
    "mistral-window": lambda: MistralConfig(**SHAPE, sliding_window=8),
    "qwen2-hybrid-window": lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3-qk-norm": lambda: Qwen3Config(**SHAPE, head_dim=32),
    "gemma": lambda: GemmaConfig(**SHAPE, head_dim=16),
    "gemma2-softcaps-windows": lambda: Gemma2Config(
        **SHAPE,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    ),
}
# Each family's real config.json (the capacity presets; Gemma 7B is GemmaConfig's defaults) with
# its sizes scaled down and everything else kept: rotary scaling, windows, soft-caps, tying, ...
REAL_CONFIGS = {
    "llama-3.1-8b": MODEL_PRESETS["llama-3.1-8b"],
    "llama-3.2-1b": MODEL_PRESETS["llama-3.2-1b"],
    "smollm2-135m": MODEL_PRESETS["smollm2-135m"],
    "mistral-7b": MODEL_PRESETS["mistral-7b"],
    "qwen2.5-7b": MODEL_PRESETS["qwen2.5-7b"],
    "qwen3-8b": MODEL_PRESETS["qwen3-8b"],
    "gemma-7b": GemmaConfig().to_dict(),
    "gemma-2-9b": MODEL_PRESETS["gemma-2-9b"],
}


def scaled_down(name: str):
    """``REAL_CONFIGS[name]`` at test size: 2 layers of width 64, a vocabulary of 256, windows
    of 8 and a Llama-3 rotary context of 64 tokens, so each option acts within the prompts."""
    cfg = json.loads(json.dumps(REAL_CONFIGS[name]))
    heads = 4
    kv_heads = max(1, heads * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // cfg["num_attention_heads"])
    cfg |= {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if cfg.get("head_dim"):
        cfg["head_dim"] = 16
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 8
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:2]
    if (cfg.get("rope_scaling") or {}).get("original_max_position_embeddings"):
        cfg["rope_scaling"]["original_max_position_embeddings"] = 64
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


CASES |= {f"real-{name}": functools.partial(scaled_down, name) for name in REAL_CONFIGS}


def checkpoint(name: str, path):
    """A seeded HF model of ``CASES[name]`` saved at ``path``; its weights scaled up so greedy
    output varies token to token (the default init repeats one token)."""
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(CASES[name]()).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0).add_(0.1 * torch.randn_like(param) if param.dim() == 1 else 0)
    model.save_pretrained(path)
    return model


def prompt(length: int = 23) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(5)).tolist()


def executor(model, max_seq_len: int = 128):
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.float32), 2048, 4, "cpu")
    return create_executor(model, cache, SchedulerConfig(8, 64, max_seq_len), start=False)


def last_logits(ex, ids: list[int]) -> torch.Tensor:
    """The engine's logits at the prompt's last position, from one prefill step."""
    ex.scheduler.add(Sequence(next_request_id(), ids, SamplingParams(max_tokens=1)))
    return ex.runner.run(ex.scheduler.schedule())[-1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_own_model_matches_transformers(name, tmp_path):
    reference = checkpoint(name, tmp_path)
    own = load_own_model(tmp_path, CPU, torch.float32)
    assert isinstance(own, DecoderLM)
    ids = prompt()
    ex = executor(own)
    try:
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(last_logits(ex, ids), expected, atol=1e-4, rtol=0)
        ex.scheduler.drain()
        [response] = ex.generate([ids], SamplingParams(max_tokens=64, ignore_eos=True))
        greedy = reference.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=64, attention_mask=None
        )[0, len(ids) :].tolist()
        assert response.token_ids == greedy
    finally:
        ex.shutdown()


def test_a_checkpoint_directory_loads_into_the_own_code_through_the_engine_loader(tmp_path):
    checkpoint("qwen3-qk-norm", tmp_path)
    loaded = load_model(str(tmp_path), device=CPU)
    assert isinstance(loaded.model, DecoderLM) and loaded.hf_config is loaded.model.config
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]  # the rotary frequencies too
    assert loaded.weight_bytes == sum(t.numel() * t.element_size() for t in tensors)
    reference = load_model(
        str(tmp_path), device=CPU, attn_implementation="eager"
    )  # the reference stays on transformers
    assert not isinstance(reference.model, DecoderLM)


def test_a_sharded_checkpoint_loads_every_shard(tmp_path):
    reference = checkpoint("llama", tmp_path)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    own = load_own_model(tmp_path, CPU, torch.float32)
    assert torch.equal(own.model.layers[1].mlp.down_proj.weight, reference.model.layers[1].mlp.down_proj.weight)
    attention, expected = own.model.layers[0].self_attn, reference.model.layers[0].self_attn
    _q, k, v = attention.qkv_proj.split(attention.qkv_proj.weight.T)  # split by output rows
    assert torch.equal(k.T, expected.k_proj.weight) and torch.equal(v.T, expected.v_proj.weight)


def test_a_checkpoint_in_another_dtype_is_converted_on_its_way_in(tmp_path):
    reference = checkpoint("llama-attention-bias-tied", tmp_path)  # stored float32, read as bfloat16
    own = load_own_model(tmp_path, CPU, torch.bfloat16)
    expected = reference.model.layers[0].self_attn
    _q, _k, v = own.model.layers[0].self_attn.qkv_proj.split(own.model.layers[0].self_attn.qkv_proj.weight.T)
    assert own.dtype == torch.bfloat16 and torch.equal(v.T, expected.v_proj.weight.to(torch.bfloat16))
    assert torch.equal(
        own.model.layers[1].mlp.down_proj.weight, reference.model.layers[1].mlp.down_proj.weight.bfloat16()
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t | {"model.layers.0.extra.weight": torch.zeros(2)}, "'model.layers.0.extra.weight' has no place"),
        (
            lambda t: {k: v for k, v in t.items() if "layers.1.mlp.down_proj" not in k},
            "no tensor for 1 parameter.*layers.1.mlp",
        ),
        (
            lambda t: t | {"model.norm.weight": torch.ones(65)},
            r"model.norm.weight: checkpoint shape \(65,\), the model's \(64,\)",
        ),
        (
            lambda t: t | {"model.layers.0.self_attn.k_proj.weight": torch.ones(10, 64)},
            r"k_proj.weight: checkpoint shape \(10, 64\)",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_before_any_weight_is_read(change, match, tmp_path):
    from safetensors.torch import load_file, save_file

    from bootstrap.engine.models import build_own_model
    from bootstrap.engine.models.weights import load_weights

    checkpoint("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(change(tensors), tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = build_own_model(json.loads((tmp_path / "config.json").read_text()), CPU, torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    with pytest.raises(ValueError, match=match):
        load_weights(model, [tmp_path / "model.safetensors"])
    assert all(param.isnan().all() for param in model.parameters())  # nothing was read


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"model_type": "phi3"}, "model_type 'phi3'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope scaling 'longrope'"),
        ({"hidden_act": "relu2"}, "activation 'relu2'"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_what_the_own_code_does_not_implement_stays_on_transformers(change, problem, tmp_path):
    config = {**LlamaConfig(**SHAPE).to_dict(), **change}
    assert problem in own_model_problem(config)
    checkpoint("llama", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()), **change}))
    assert load_own_model(tmp_path, CPU, torch.float32) is None


def test_the_families_are_those_the_issue_names_for_this_decoder():
    assert FAMILIES == ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")


def test_gemma_legacy_gelu_runs_the_tanh_form_as_transformers_does(tmp_path):
    """Official Gemma configs say ``"hidden_act": "gelu"``; transformers' GemmaConfig reads it as
    the tanh approximation, the form the weights were trained with."""
    checkpoint("gemma", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | {"hidden_act": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # the file as it reads it
    own = load_own_model(tmp_path, CPU, torch.float32)
    x = 3 * torch.randn(16, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))  # where the forms differ
    with torch.no_grad():
        torch.testing.assert_close(own.model.layers[0].mlp(x), reference.model.layers[0].mlp(x), atol=1e-5, rtol=1e-5)
        expected = reference(torch.tensor([prompt()])).logits[0, -1]
    ex = executor(own)
    try:
        assert torch.allclose(last_logits(ex, prompt()), expected, atol=1e-4, rtol=0)
    finally:
        ex.scheduler.drain()
        ex.shutdown()
