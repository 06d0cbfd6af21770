"""Tiny GGUF files written from a transformers Llama (``gguf.GGUFWriter``, float32 tensors), as
llama.cpp's converter lays them out: q/k rows permuted, a byte-level BPE vocabulary with one
merge ("a b"); nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers import LlamaConfig, LlamaForCausalLM

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF q/k row order (what llama.cpp's converter does; transformers undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(key: str, value: np.ndarray, config: LlamaConfig) -> tuple[str, np.ndarray]:
    if key in _GGUF_TOP:
        return _GGUF_TOP[key], value
    _, _, layer, *rest = key.split(".")
    part = ".".join(rest[:-1])
    if part == "self_attn.q_proj":
        value = _permute(value, config.num_attention_heads)
    elif part == "self_attn.k_proj":
        value = _permute(value, config.num_key_value_heads)
    return f"blk.{layer}.{_GGUF_LAYER[part]}.weight", value


def write_tiny_gguf(path: Path, model: LlamaForCausalLM) -> Path:
    """``model`` (vocab_size >= 30) as a GGUF file at ``path``; returns ``path``."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    tokens = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "ab"]
    tokens += [f"x{i}" for i in range(c.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, tensor in model.state_dict().items():
        writer.add_tensor(*_gguf_name(key, tensor.float().numpy(), c))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
