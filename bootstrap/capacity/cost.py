"""KV bytes per token: ``CacheCost`` and the pricing of a model's layers (full attention, MLA,
sliding windows, recurrent state) on one tensor-parallel rank, for the final pools and the probe."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from bootstrap.capacity.errors import CapacityError, ceil_to, check_positive
from bootstrap.capacity.shape import ModelShape
from bootstrap.config import is_int

_KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class CacheCost:
    """KV cost of a pool: ``bytes(tokens) = slope * tokens + intercept``.

    ``slope`` is bytes per cached token; ``intercept`` is fixed bytes that do not grow with
    tokens (sliding-window and recurrent state for ``max_batch_size`` sequences).
    """

    slope: int
    intercept: int = 0

    def __post_init__(self) -> None:
        for name in ("slope", "intercept"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"CacheCost.{name} must be an integer >= 0, got {value!r}")

    def bytes_for_tokens(self, tokens: int) -> int:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return self.slope * tokens + self.intercept

    def tokens_for_budget(self, budget: int) -> int:
        """Tokens a budget holds after the intercept: ``max((budget - intercept) // slope, 0)``."""
        if self.slope == 0:
            raise CapacityError("a KV pool with no per-token cost (slope 0) has no token capacity")
        return max((budget - self.intercept) // self.slope, 0)

    def __add__(self, other: CacheCost) -> CacheCost:
        if not isinstance(other, CacheCost):
            return NotImplemented
        return CacheCost(self.slope + other.slope, self.intercept + other.intercept)


def kv_dtype_bytes(name: str) -> int | float:
    """Bytes per KV element for a resolved ``kv_cache_dtype`` (not "auto")."""
    try:
        return _KV_DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(_KV_DTYPE_BYTES)}, got {name!r}") from None


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one rank caches: ``ceil(kv_heads / tp)``.

    With fewer KV heads than ranks each head is replicated, so every rank still holds one head
    (TensorRT-LLM divides ``kv_heads / tp`` as a float, which under-counts that case).
    """
    return -(-kv_heads // tp)


def mha_cost(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int | float, tp: int = 1) -> CacheCost:
    """MHA/GQA/MQA on one rank: ``2 * layers * ceil(kv_heads / tp) * head_dim * dtype_bytes``."""
    check_positive(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, tp=tp)
    return CacheCost(math.ceil(2 * layers * _kv_heads_per_rank(kv_heads, tp) * head_dim * dtype_bytes))


def mla_cost(*, layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int | float) -> CacheCost:
    """MLA latent cache: ``layers * (kv_lora_rank + rope_dim) * dtype_bytes`` (K only, no TP split)."""
    check_positive(layers=layers, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype_bytes=dtype_bytes)
    return CacheCost(math.ceil(layers * (kv_lora_rank + rope_dim) * dtype_bytes))


def _layer_bytes_per_token(shape: ModelShape, dtype_bytes: int | float, tp: int) -> int:
    if shape.kv_lora_rank is not None:
        return mla_cost(
            layers=1, kv_lora_rank=shape.kv_lora_rank, rope_dim=shape.qk_rope_head_dim, dtype_bytes=dtype_bytes
        ).slope
    return mha_cost(
        layers=1, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype_bytes=dtype_bytes, tp=tp
    ).slope


def model_cost(
    shape: ModelShape,
    *,
    kv_dtype_bytes: int | float,
    tp: int,
    max_batch_size: int,
    tokens_per_block: int,
    max_seq_len: int | None = None,
) -> CacheCost:
    """Cost of a model's KV cache on one rank, for requests of at most ``max_seq_len`` tokens
    (default: the model's ``max_position_embeddings``).

    A window of ``max_seq_len`` tokens or more never slides, so such a layer is priced as full
    attention (TensorRT-LLM treats attention as SWA only when ``max_seq_len > min(window)``).
    Full-attention layers go to the slope. Each sliding-window layer adds
    ``max_batch_size * ceil(window / tpb) * tpb * layer_bytes`` to the intercept (TensorRT-LLM V2's
    ``gen_swa_req``; its context-phase SWA term is left out: windows are priced at full length,
    which already bounds a request). When *every* attention layer is windowed the layers are
    priced as full attention instead, so the slope stays positive and errs on the safe side.
    Recurrent state adds ``max_batch_size * ceil(state_elements / tp) * layers * dtype_bytes``
    (the state shards with the Mamba inner dimension; it uses the KV dtype).
    """
    per_layer = _checked_layer_bytes(shape, kv_dtype_bytes, tp, max_batch_size, tokens_per_block)
    longest = max_seq_len if max_seq_len is not None else shape.max_position_embeddings
    windows = shape.attention_windows
    sliding = [w for w in windows if w is not None and w < longest]
    if len(sliding) == len(windows):
        sliding = []
    slope = (len(windows) - len(sliding)) * per_layer
    window_bytes = sum(ceil_to(w, tokens_per_block) * per_layer for w in sliding)
    return CacheCost(slope, max_batch_size * (window_bytes + _recurrent_state_bytes(shape, kv_dtype_bytes, tp)))


def probe_cost(
    shapes: Iterable[ModelShape | None], *, kv_dtype_bytes: int | float, tp: int, max_batch_size: int
) -> CacheCost:
    """Cost of the estimation probe of the models in ``shapes`` (target, draft; ``None`` skipped).

    Every attention layer, windowed or not, holds every probe token: TensorRT-LLM's V1 estimation
    managers give each window the same ``max_tokens // tpb`` blocks (``is_estimating_kv_cache``),
    and its V1 cost per token counts every layer at full length. That bounds what the dummy
    workload needs (a windowed layer keeps at most its window of each dummy request). The plan's
    per-sequence window state (``model_cost``'s intercept, ``max_batch_size`` live sequences) is
    left out: the dummies are a few requests, not ``max_batch_size`` windows. Recurrent state stays
    (the V1 estimation managers keep ``max_batch_size`` state slots).
    """
    total = CacheCost(0)
    for shape in (s for s in shapes if s is not None):
        per_layer = _checked_layer_bytes(shape, kv_dtype_bytes, tp, max_batch_size, 1)
        state = max_batch_size * _recurrent_state_bytes(shape, kv_dtype_bytes, tp)
        total = total + CacheCost(len(shape.attention_windows) * per_layer, state)
    return total


def _checked_layer_bytes(
    shape: ModelShape, kv_dtype_bytes: int | float, tp: int, max_batch_size: int, tokens_per_block: int
) -> int:
    check_positive(tp=tp, max_batch_size=max_batch_size, tokens_per_block=tokens_per_block)
    if shape.num_heads % tp:
        raise CapacityError(
            f"tensor_parallel_size ({tp}) must divide the {shape.num_heads} attention heads of "
            f"{shape.architecture}; choose a divisor of {shape.num_heads}"
        )
    return _layer_bytes_per_token(shape, kv_dtype_bytes, tp)


def _recurrent_state_bytes(shape: ModelShape, kv_dtype_bytes: int | float, tp: int) -> int:
    """One sequence's recurrent state on one rank, every recurrent layer."""
    return shape.num_recurrent_layers * math.ceil(-(-shape.recurrent_state_elements // tp) * kv_dtype_bytes)
