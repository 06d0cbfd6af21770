"""`ModelShape`: a Hugging Face ``config.json`` normalized to the figures capacity math needs.

Pure (no torch import). Supported families: Llama, Mistral, Mixtral (MoE), Qwen2, Qwen3,
Gemma, Gemma2 (alternating sliding windows), DeepSeek-V2/V3 (MLA + MoE with shared experts and
dense-first layers) and Jamba (hybrid attention / Mamba layers, the source of recurrent state).
A config with ``layer_types`` ("full_attention" / "sliding_attention") sets the windows directly.

Normalization rules worth knowing:
- a sliding window at least as long as ``max_position_embeddings`` is full attention (None);
- Qwen2/Qwen3 windows apply only with ``use_sliding_window`` (layers >= ``max_window_layers``);
- Gemma2 without ``layer_types``: even layers slide, odd layers are global (as transformers does);
- recurrent state per Mamba layer and sequence = conv state ``d_inner * (d_conv - 1)`` plus SSM
  state ``d_inner * d_state`` elements (the vLLM / TensorRT-LLM layout; transformers keeps a
  ``d_conv``-wide conv buffer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bootstrap.config import ConfigError

if TYPE_CHECKING:
    from bootstrap.capacity.quantization import WeightQuantization

MHA, GQA, MQA, MLA = "mha", "gqa", "mqa", "mla"
ATTENTION, RECURRENT = "attention", "recurrent"


class ModelConfigError(ValueError):
    """A config.json is unsupported or lacks / mistypes a field; the message names both."""


@dataclass(frozen=True)
class ModelShape:
    """Normalized model geometry. Per-layer tuples have one entry per decoder layer."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None
    layer_kinds: tuple[str, ...]  # "attention" | "recurrent"
    layer_windows: tuple[int | None, ...]  # sliding window of each layer; None: full (or recurrent)
    moe_layers: tuple[bool, ...] = ()  # True where the MLP is a mixture of experts
    attention_bias: bool = False  # bias on q/k/v/o projections (Llama-style attention_bias)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    norms_per_layer: int = 2
    # MLA (DeepSeek-V2/V3); None elsewhere
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # MoE; num_experts == 0 for dense models
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    expert_score_bias: bool = False  # DeepSeek-V3 noaux_tc routing keeps a per-expert bias
    # recurrent (Mamba) layers
    recurrent_state_elements: int = 0  # per recurrent layer and sequence
    mamba_d_inner: int = 0
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_dt_rank: int = 0
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    quantization: WeightQuantization | None = None  # FP8 weights (``capacity.quantization``), else 16 bits

    @property
    def attention_kind(self) -> str:
        """ "mla", or "mha" / "gqa" / "mqa" by the ratio of KV heads to query heads."""
        if self.kv_lora_rank is not None:
            return MLA
        if self.num_kv_heads == self.num_heads:
            return MHA
        return MQA if self.num_kv_heads == 1 else GQA

    @property
    def num_attention_layers(self) -> int:
        return self.layer_kinds.count(ATTENTION)

    @property
    def num_recurrent_layers(self) -> int:
        return self.layer_kinds.count(RECURRENT)

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """Window of each attention layer (None: full attention), recurrent layers left out."""
        return tuple(w for k, w in zip(self.layer_kinds, self.layer_windows) if k == ATTENTION)

    def recurrent_state_bytes(self, dtype_bytes: float) -> int:
        """Recurrent state of one sequence over all recurrent layers."""
        return math.ceil(self.num_recurrent_layers * self.recurrent_state_elements * dtype_bytes)

    def parameter_count(self) -> int:
        """Parameters as the checkpoint stores them (embeddings, layers, norms, untied lm_head)."""
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embeddings
        layers = sum(self._layer_params(i) for i in range(self.num_layers))
        return embeddings + layers + self.hidden_size + lm_head

    def weight_bytes(self, dtype_bytes: float) -> int:
        """Bytes of all parameters at ``dtype_bytes`` per parameter; with FP8 weights, their
        projections at 1 byte each plus their scales."""
        total = self.parameter_count() * dtype_bytes
        q = self.quantization
        if q is not None and q.fp8:
            for module, rows, columns in self.projections():
                if not q.ignores(module):
                    total -= rows * columns * (dtype_bytes - 1)
                    total += q.scale_bytes(rows, columns)
        return math.ceil(total)

    def projections(self) -> Iterator[tuple[str, int, int]]:
        """Every attention and MLP (expert) projection matrix: its module name as checkpoints
        name it, output rows and input columns."""
        h = self.hidden_size
        for i, kind in enumerate(self.layer_kinds):
            if kind == ATTENTION:
                for name, rows, columns in self._attention_projections():
                    yield f"model.layers.{i}.self_attn.{name}", rows, columns
            if not self.moe_layers[i]:
                yield from _mlp_projections(f"model.layers.{i}.mlp", h, self.intermediate_size)
                continue
            for e in range(self.num_experts):
                yield from _mlp_projections(f"model.layers.{i}.mlp.experts.{e}", h, self.moe_intermediate_size)
            if self.num_shared_experts:
                shared = self.shared_expert_intermediate_size
                yield from _mlp_projections(f"model.layers.{i}.mlp.shared_experts", h, shared)

    def _attention_projections(self) -> list[tuple[str, int, int]]:
        h, heads = self.hidden_size, self.num_heads
        if self.kv_lora_rank is None:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)]
        qk_head, rank = self.qk_nope_head_dim + self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            query = [("q_proj", heads * qk_head, h)]
        else:
            query = [("q_a_proj", self.q_lora_rank, h), ("q_b_proj", heads * qk_head, self.q_lora_rank)]
        return [
            *query,
            ("kv_a_proj_with_mqa", rank + self.qk_rope_head_dim, h),
            ("kv_b_proj", heads * (self.qk_nope_head_dim + self.v_head_dim), rank),
            ("o_proj", h, heads * self.v_head_dim),
        ]

    def fingerprint(self) -> str:
        """Stable sha256 of the normalized shape (same shape, same hash, whatever the key order)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def _layer_params(self, index: int) -> int:
        mixer = self._attention_params() if self.layer_kinds[index] == ATTENTION else self._mamba_params()
        if self.moe_layers[index]:
            mlp = self._moe_params()
        else:
            mlp = _mlp(self.hidden_size, self.intermediate_size, self.mlp_bias)
        return mixer + mlp + self.norms_per_layer * self.hidden_size

    def _attention_params(self) -> int:
        if self.kv_lora_rank is not None:
            return self._mla_params()
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        params = 2 * h * q + 2 * h * kv
        if self.attention_bias:
            params += q + 2 * kv + h
        elif self.qkv_bias:
            params += q + 2 * kv
        return params + (2 * self.head_dim if self.qk_norm else 0)

    def _mla_params(self) -> int:
        h, heads, rope, rank = self.hidden_size, self.num_heads, self.qk_rope_head_dim, self.kv_lora_rank
        qk_head = self.qk_nope_head_dim + rope
        bias = self.attention_bias
        if self.q_lora_rank is None:
            query = h * heads * qk_head
        else:
            query = h * self.q_lora_rank + bias * self.q_lora_rank + self.q_lora_rank * (1 + heads * qk_head)
        kv = h * (rank + rope) + bias * (rank + rope) + rank + rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return query + kv + heads * self.v_head_dim * h + bias * h

    def _moe_params(self) -> int:
        h = self.hidden_size
        router = self.num_experts * h + (self.num_experts if self.expert_score_bias else 0)
        experts = self.num_experts * 3 * h * self.moe_intermediate_size
        shared = _mlp(h, self.shared_expert_intermediate_size, False) if self.num_shared_experts else 0
        return router + experts + shared

    def _mamba_params(self) -> int:
        h, d, n, r, k = self.hidden_size, self.mamba_d_inner, self.mamba_d_state, self.mamba_dt_rank, self.mamba_d_conv
        proj_bias = self.mamba_proj_bias
        in_proj = h * 2 * d + proj_bias * 2 * d
        conv = d * k + (d if self.mamba_conv_bias else 0)
        x_proj, dt_proj = d * (r + 2 * n), r * d + d
        ssm = d * n + d  # A_log, D
        out_proj = d * h + proj_bias * h
        return in_proj + conv + x_proj + dt_proj + ssm + out_proj + r + 2 * n  # + dt/B/C norms


def _mlp_projections(prefix: str, hidden: int, inner: int) -> Iterator[tuple[str, int, int]]:
    yield f"{prefix}.gate_proj", inner, hidden
    yield f"{prefix}.up_proj", inner, hidden
    yield f"{prefix}.down_proj", hidden, inner


def _mlp(hidden: int, inner: int, bias: bool) -> int:
    return 3 * hidden * inner + ((2 * inner + hidden) if bias else 0)


def check_tp_split(shape: ModelShape, tp: int, field: str = "model", shard_kv_heads: bool = False) -> None:
    """``ConfigError`` unless ``tp`` ranks can split the model: it must divide the attention
    heads, and with ``shard_kv_heads`` (the native engine, which shards KV heads evenly instead of
    replicating them) the KV heads too."""
    if shape.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the {shape.num_heads} attention heads of "
            f"{field} ({shape.architecture}); choose a divisor of {shape.num_heads}"
        )
    if shard_kv_heads and shape.num_kv_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the {shape.num_kv_heads} KV heads of "
            f"{field} ({shape.architecture}); the native engine shards KV heads evenly (choose a "
            f"divisor of {shape.num_kv_heads})"
        )
