"""One dense decoder for llama (SmolLM2 included), mistral, qwen2, qwen3, gemma and gemma2, told
apart by options read from ``config.json`` (``bootstrap.capacity``'s ``ModelShape`` plus the
norm epsilon, the activation, the rotary settings and Gemma's extras).

Fused q/k/v and gate/up projections, RMSNorm (Gemma's ``1 + weight`` form), rotary embeddings
(``layers.rotary``), q/k/v bias (qwen2, or Llama's ``attention_bias``, which covers o too),
per-head q/k norm (qwen3), a sliding window per layer, tied embeddings; for Gemma the embeddings
scaled by ``sqrt(hidden_size)`` and a GELU MLP, and for Gemma 2 also four norms per layer (the
attention and MLP outputs normed before their residual add), ``query_pre_attn_scalar`` and the
attention and final logit soft-caps. Attention goes to the engine's paged attention function
directly, with the step's metadata as an argument. The model answers the surface the engine's
runner uses (``forward(input_ids, position_ids, logits_to_keep)`` with ``.logits``, ``config``,
``generation_config``, ``get_output_embeddings``), so the runner, the CUDA graphs and the pools
treat it like any model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from bootstrap.capacity.shape import ModelShape
from bootstrap.engine.kernels import fused
from bootstrap.engine.layers.attention import ATTN_IMPLEMENTATION, AttentionMetadata, DecodeMetadata, attend
from bootstrap.engine.layers.linear import FusedLinear, HeadLinear, RowLinear, Shard
from bootstrap.engine.layers.norm import RMSNorm
from bootstrap.engine.layers.rotary import Rotary, rotate_qk

Device = torch.device | str | None
Metadata = AttentionMetadata | DecodeMetadata


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
    hidden_act: str = "silu"
    original_max_position_embeddings: int | None = None  # a top-level one overrides the scaling's
    norm_offset: float = 0.0  # 1.0: Gemma's (1 + weight) norms
    embed_scale: float | None = None  # Gemma: sqrt(hidden_size), in the weights' dtype
    sandwich_norms: bool = False  # Gemma 2: post-attention and pre/post-feed-forward norms
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    _attn_implementation: str = field(default=ATTN_IMPLEMENTATION, repr=False)

    @classmethod
    def from_shape(cls, shape: ModelShape, cfg: dict[str, Any]) -> DecoderConfig:
        return cls(
            model_type=shape.model_type,
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_position_embeddings=shape.max_position_embeddings,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta(cfg)),
            rope_scaling=cfg.get("rope_scaling") or cfg.get("rope_parameters"),
            tie_word_embeddings=shape.tie_word_embeddings,
            qkv_bias=shape.qkv_bias or shape.attention_bias,
            o_bias=shape.attention_bias,
            qk_norm=shape.qk_norm,
            layer_windows=shape.layer_windows,
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=shape.torch_dtype,
            hidden_act=activation_name(cfg),
            original_max_position_embeddings=cfg.get("original_max_position_embeddings"),
            **_gemma_options(cfg, shape),
        )

    def get_text_config(self) -> DecoderConfig:
        return self


def rope_theta(cfg: dict[str, Any]) -> float:
    """``rope_theta``, or where transformers 5 writes it (``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    return cfg.get("rope_theta") or params.get("rope_theta") or 10000.0


def activation_name(cfg: dict[str, Any]) -> str:
    """The MLP activation, from the field transformers reads for the family (Gemma 2:
    ``hidden_activation``; the others: ``hidden_act``, where Gemma's legacy ``"gelu"``, what the
    official configs carry, means the tanh form, as transformers' ``GemmaConfig`` reads it)."""
    if cfg.get("model_type") == "gemma2":
        return cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if cfg.get("model_type") == "gemma":
        return "gelu_pytorch_tanh" if cfg.get("hidden_act") in (None, "gelu") else cfg["hidden_act"]
    return cfg.get("hidden_act") or "silu"


def _gemma_options(cfg: dict[str, Any], shape: ModelShape) -> dict[str, Any]:
    if shape.model_type not in ("gemma", "gemma2"):
        return {}
    options: dict[str, Any] = {"norm_offset": 1.0, "embed_scale": shape.hidden_size**0.5}
    if shape.model_type == "gemma2":
        options |= {
            "sandwich_norms": True,
            "attention_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
            "attn_softcap": cfg.get("attn_logit_softcapping"),
            "final_softcap": cfg.get("final_logit_softcapping"),
        }
    return options


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class Attention(torch.nn.Module):
    """This rank's heads: q/k/v column-parallel, o row-parallel (``layers.linear``)."""

    def __init__(self, config: DecoderConfig, layer_idx: int, device: Device = None, shard: Shard = Shard()) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer_idx, self.head_dim = layer_idx, head_dim
        self.heads, self.kv_heads = shard.local(heads, "attention heads"), shard.local(kv_heads, "KV heads")
        self.sliding_window = config.layer_windows[layer_idx]
        self.scaling = config.attention_scale or head_dim**-0.5
        self.softcap = config.attn_softcap
        parts = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
        self.qkv_proj = FusedLinear(config.hidden_size, parts, bias=config.qkv_bias, device=device, shard=shard)
        self.o_proj = RowLinear(heads * head_dim, config.hidden_size, bias=config.o_bias, device=device, shard=shard)
        self.q_norm = norm(config, head_dim, device) if config.qk_norm else None
        self.k_norm = norm(config, head_dim, device) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: Metadata) -> torch.Tensor:
        """``x [T, hidden]`` to ``[T, hidden]``; keys and values go to the paged KV cache."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(tokens, self.heads, self.head_dim)
        k = k.view(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_qk(q, k, cos, sin)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        out = attend(metadata, self.layer_idx, q, k, v, self.scaling, self.sliding_window, self.softcap)
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


def norm(config: DecoderConfig, dim: int, device: Device) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, offset=config.norm_offset, device=device)


class MLP(torch.nn.Module):
    """gate/up column-parallel, down row-parallel."""

    def __init__(self, config: DecoderConfig, device: Device = None, shard: Shard = Shard()) -> None:
        super().__init__()
        size, parts = (
            config.intermediate_size,
            {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size},
        )
        self.gate_up_proj = FusedLinear(config.hidden_size, parts, device=device, shard=shard)
        self.down_proj = RowLinear(size, config.hidden_size, bias=False, device=device, shard=shard)
        self.activation = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.usable(gate_up):
            return self.down_proj(fused.act_mul(gate_up, self.activation))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, device: Device = None, shard: Shard = Shard()) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, device, shard)
        self.mlp = MLP(config, device, shard)
        self.input_layernorm = norm(config, config.hidden_size, device)
        self.post_attention_layernorm = norm(config, config.hidden_size, device)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(config, config.hidden_size, device)
            self.post_feedforward_layernorm = norm(config, config.hidden_size, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, metadata: Metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is ``x + residual`` (``residual`` None: ``x``): each residual add
        is folded into the norm that follows it. Returns the layer's ``(output, residual)``."""
        h, residual = self.input_layernorm(x, residual) if residual is not None else (self.input_layernorm(x), x)
        h = self.self_attn(h, cos, sin, metadata)
        if self.sandwich:  # Gemma 2: the attention and MLP outputs normed before their residual add
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderBody(torch.nn.Module):
    """Embeddings, layers and the final norm (``model.*`` in the checkpoint); the embeddings and
    norms are whole on every rank."""

    def __init__(self, config: DecoderConfig, device: Device = None, shard: Shard = Shard()) -> None:
        super().__init__()
        # Given its weight, Embedding skips its normal_ initialiser, which on meta goes through
        # torch's Python references and imports torch._dynamo (slow to import).
        weight = torch.empty(config.vocab_size, config.hidden_size, device=device)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i, device, shard) for i in range(config.num_hidden_layers)
        )
        self.norm = norm(config, config.hidden_size, device)
        self.rotary = Rotary(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
            original_max_position_embeddings=config.original_max_position_embeddings,
        )
        self.embed_scale = config.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Metadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # rounded to the weights' dtype first, as Gemma does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, metadata)
        return self.norm(x, residual)[0]


class DecoderLM(torch.nn.Module):
    """The causal LM: the body and the output head (tied to the embeddings where the config says;
    whole on every rank, so each rank samples from the full logits)."""

    def __init__(
        self,
        config: DecoderConfig,
        generation_eos: int | list[int] | None = None,
        device: Device = None,
        shard: Shard = Shard(),
    ) -> None:
        """``device="meta"``: no memory and no initialisation (the loader fills every weight);
        ``shard``: this rank's part under tensor parallelism (the KV cache holds its KV heads)."""
        super().__init__()
        self.config = config
        self.tp_size = shard.size
        self.generation_config = SimpleNamespace(eos_token_id=generation_eos)
        self.model = DecoderBody(config, device, shard)
        self.lm_head = HeadLinear(config.hidden_size, config.vocab_size, bias=False, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The head shares the embeddings' weight where the config says (again after a move
        between devices, which may give each its own tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor | int,
        metadata: Metadata,
    ) -> SimpleNamespace:
        """``input_ids, position_ids [1, T]``; logits ``[1, kept, vocab]`` at ``logits_to_keep``
        (indices, or the last N tokens; 0: all), as the runner asks a transformers model; the
        step's attention ``metadata`` (``bootstrap.engine.layers.attention``) as an argument."""
        hidden = self.model(input_ids[0], position_ids[0], metadata)
        if isinstance(logits_to_keep, int):
            hidden = hidden[-logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden.index_select(0, logits_to_keep)
        logits = self.lm_head(hidden)
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return SimpleNamespace(logits=logits.unsqueeze(0))

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
