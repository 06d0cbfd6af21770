"""One dense decoder for the Llama family: llama (SmolLM2 included), mistral, qwen2 and qwen3,
told apart by options read from ``config.json`` (``bootstrap.capacity``'s ``ModelShape`` plus
the norm epsilon and the rotary settings).

Fused q/k/v and gate/up projections, RMSNorm, rotary embeddings (``layers.rotary``), q/k/v bias
(qwen2, or Llama's ``attention_bias``, which covers o too), per-head q/k norm (qwen3), a sliding
window per layer, tied embeddings. Attention goes to the engine's paged attention function
directly. The model answers the surface the engine's runner uses (``forward(input_ids,
position_ids, logits_to_keep)`` with ``.logits``, ``config``, ``generation_config``,
``get_output_embeddings``), so the runner, the CUDA graphs and the pools treat it like any model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from bootstrap.capacity.shape import ModelShape
from bootstrap.engine.attention import ATTN_IMPLEMENTATION, paged_attention
from bootstrap.engine.layers.linear import FusedLinear
from bootstrap.engine.layers.norm import RMSNorm
from bootstrap.engine.layers.rotary import Rotary, apply_rotary

Device = torch.device | str | None


@dataclass
class DecoderConfig:
    """What the engine reads of a model's config (the attribute names transformers uses)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    _attn_implementation: str = field(default=ATTN_IMPLEMENTATION, repr=False)

    @classmethod
    def from_shape(cls, shape: ModelShape, cfg: dict[str, Any]) -> DecoderConfig:
        return cls(
            model_type=shape.model_type, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta(cfg)), rope_scaling=cfg.get("rope_scaling") or cfg.get("rope_parameters"),
            tie_word_embeddings=shape.tie_word_embeddings, qkv_bias=shape.qkv_bias or shape.attention_bias,
            o_bias=shape.attention_bias, qk_norm=shape.qk_norm, layer_windows=shape.layer_windows,
            eos_token_id=cfg.get("eos_token_id"), bos_token_id=cfg.get("bos_token_id"), torch_dtype=shape.torch_dtype,
        )  # fmt: skip

    def get_text_config(self) -> DecoderConfig:
        return self


def rope_theta(cfg: dict[str, Any]) -> float:
    """``rope_theta``, or where transformers 5 writes it (``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    return cfg.get("rope_theta") or params.get("rope_theta") or 10000.0


class Attention(torch.nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer_idx, self.heads, self.kv_heads, self.head_dim = layer_idx, heads, kv_heads, head_dim
        self.sliding_window = config.layer_windows[layer_idx]
        self.scaling = head_dim**-0.5
        parts = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
        self.qkv_proj = FusedLinear(config.hidden_size, parts, bias=config.qkv_bias, device=device)
        self.o_proj = torch.nn.Linear(heads * head_dim, config.hidden_size, bias=config.o_bias, device=device)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, device=device) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, device=device) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` to ``[T, hidden]``; keys and values go to the paged KV cache."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(tokens, self.heads, self.head_dim)
        k = k.view(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        out, _ = paged_attention(self, *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), None,
                                 scaling=self.scaling, sliding_window=self.sliding_window)  # fmt: skip
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


class MLP(torch.nn.Module):
    def __init__(self, config: DecoderConfig, device: Device = None) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, device=device)
        self.down_proj = torch.nn.Linear(size, config.hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, device)
        self.mlp = MLP(config, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(torch.nn.Module):
    """Embeddings, layers and the final norm (``model.*`` in the checkpoint)."""

    def __init__(self, config: DecoderConfig, device: Device = None) -> None:
        super().__init__()
        # Given its weight, Embedding skips its normal_ initialiser, which on meta goes through
        # torch's Python references and imports torch._dynamo (1.7 s on a 2-core CPU).
        weight = torch.empty(config.vocab_size, config.hidden_size, device=device)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class DecoderLM(torch.nn.Module):
    """The causal LM: the body and the output head (tied to the embeddings where the config says)."""

    def __init__(self, config: DecoderConfig, generation_eos: int | list[int] | None = None, device: Device = None) -> None:
        """``device="meta"``: no memory and no initialisation (the loader fills every weight)."""
        super().__init__()
        self.config = config
        self.generation_config = SimpleNamespace(eos_token_id=generation_eos)
        self.model = DecoderBody(config, device)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The head shares the embeddings' weight where the config says (again after a move
        between devices, which may give each its own tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor | int = 0,
                **_: Any) -> SimpleNamespace:  # fmt: skip
        """``input_ids, position_ids [1, T]``; logits ``[1, kept, vocab]`` at ``logits_to_keep``
        (indices, or the last N tokens; 0: all), as the runner asks a transformers model."""
        hidden = self.model(input_ids[0], position_ids[0])
        if isinstance(logits_to_keep, int):
            hidden = hidden[-logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden.index_select(0, logits_to_keep)
        return SimpleNamespace(logits=self.lm_head(hidden).unsqueeze(0))

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def set_attn_implementation(self, name: str) -> None:
        if name != ATTN_IMPLEMENTATION:
            raise ValueError(f"the engine's own model code runs '{ATTN_IMPLEMENTATION}' attention only, not {name!r}")
