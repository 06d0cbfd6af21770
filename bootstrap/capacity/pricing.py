"""KV pricing per backend: what a cached token costs, counted the way the KV manager that will
hold it counts it. Pure (no torch, no TensorRT-LLM import).

- ``native``: `bootstrap.capacity.model_cost` (sliding windows as a per-sequence intercept).
- ``trtllm`` ``v1`` (the default ``KVCacheManager``): every attention layer at full length,
  ``2 * layers * kv_heads/tp * head_dim * dtype`` bytes a token. With two or more windows (VSWA)
  it splits its budget *equally* between the window sizes (``calculate_max_num_blocks_for_vswa``),
  so the slope is ``n_windows * full_layers * layer_bytes`` (Gemma-2, 21 + 21 layers: all 42).
- ``trtllm`` ``v2`` (``KVCacheManagerV2``): full-attention layers in the slope; each sliding
  layer in the intercept, ``max_batch_size * ceil(window / tpb) * tpb * layer_bytes``
  (``gen_swa_req``) plus ``max_num_tokens * layer_bytes`` in prefill (``_get_quota_from_max_tokens``),
  so ``tokens_for_budget(quota)`` is what V2 holds for a quota of at least ``max_num_tokens``.
- Unlike TensorRT-LLM, on purpose: KV heads fewer than the TP size are replicated (``ceil``; TRT
  divides ``head_dim * kv_heads // tp``); an all-sliding model is priced at full length under V2.
"""

from __future__ import annotations

import math
from collections import Counter

from bootstrap.capacity import CacheCost, mha_cost, mla_cost, model_cost
from bootstrap.capacity.shape import ModelShape
from bootstrap.config import BootstrapConfig, ConfigError

TRTLLM_KV_MANAGERS = {"v1": "KVCacheManager", "v2": "KVCacheManagerV2"}


def resolve_kv_manager(config: BootstrapConfig, shape: ModelShape) -> str | None:
    """``"v1"`` / ``"v2"`` for the trtllm backend, ``None`` for native; config errors say why."""
    if config.backend != "trtllm":
        if config.kv_manager != "auto":
            raise ConfigError(f"kv_manager: {config.kv_manager!r} applies to backend 'trtllm' only; leave it 'auto'")
        return None
    if shape.num_recurrent_layers:
        raise ConfigError(
            f"model: {shape.architecture} has recurrent (Mamba) layers; the trtllm backend prices attention "
            "KV only (TensorRT-LLM's hybrid managers are not supported here); use backend 'native'"
        )
    manager = "v1" if config.kv_manager == "auto" else config.kv_manager  # TRT's default: use_kv_cache_manager_v2=False
    if manager == "v1" and (config.free_gpu_memory_fraction or 0.0) >= 1.0:
        raise ConfigError(
            f"free_gpu_memory_fraction: {config.free_gpu_memory_fraction} is not accepted by TensorRT-LLM's V1 "
            "KVCacheManager (it asserts the fraction is below 1.0); use a value below 1.0, or kv_manager 'v2'"
        )
    return manager


def kv_cost(
    shape: ModelShape, config: BootstrapConfig, *, kv_dtype_bytes: int | float, max_seq_len: int, kv_manager: str | None
) -> CacheCost:
    """One pool's cost on one rank, priced as ``kv_manager`` would (``None``: native pricing)."""
    common = dict(kv_dtype_bytes=kv_dtype_bytes, tp=config.tensor_parallel_size, max_seq_len=max_seq_len)
    if kv_manager is None:
        return model_cost(
            shape, max_batch_size=config.max_batch_size, tokens_per_block=config.tokens_per_block, **common
        )
    if kv_manager == "v1":
        return trtllm_v1_cost(shape, **common)
    return trtllm_v2_cost(
        shape,
        max_batch_size=config.max_batch_size,
        tokens_per_block=config.tokens_per_block,
        max_num_tokens=config.max_num_tokens,
        **common,
    )


def layer_bytes(shape: ModelShape, *, kv_dtype_bytes: int | float, tp: int) -> int:
    """KV bytes of one attention layer for one token on one rank (MLA: latent, no TP split)."""
    if shape.kv_lora_rank is not None:
        return mla_cost(
            layers=1, kv_lora_rank=shape.kv_lora_rank, rope_dim=shape.qk_rope_head_dim, dtype_bytes=kv_dtype_bytes
        ).slope
    return mha_cost(
        layers=1, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype_bytes=kv_dtype_bytes, tp=tp
    ).slope


def attention_windows(shape: ModelShape, max_seq_len: int) -> tuple[int, ...]:
    """Effective window of each attention layer: ``min(window, max_seq_len)``, full = ``max_seq_len``."""
    return tuple(max_seq_len if w is None else min(w, max_seq_len) for w in shape.attention_windows)


def trtllm_v1_cost(shape: ModelShape, *, kv_dtype_bytes: int | float, tp: int, max_seq_len: int) -> CacheCost:
    """V1 ``KVCacheManager``: all layers at full length; VSWA: the largest window's equal share."""
    per_layer = layer_bytes(shape, kv_dtype_bytes=kv_dtype_bytes, tp=tp)
    groups = Counter(attention_windows(shape, max_seq_len))
    if len(groups) < 2:
        return CacheCost(sum(groups.values()) * per_layer)
    return CacheCost(len(groups) * groups[max(groups)] * per_layer)


def trtllm_v2_cost(
    shape: ModelShape,
    *,
    kv_dtype_bytes: int | float,
    tp: int,
    max_batch_size: int,
    tokens_per_block: int,
    max_seq_len: int,
    max_num_tokens: int,
) -> CacheCost:
    """V2 ``KVCacheManagerV2``: full layers in the slope, sliding windows' batch and prefill cost fixed."""
    per_layer = layer_bytes(shape, kv_dtype_bytes=kv_dtype_bytes, tp=tp)
    windows = attention_windows(shape, max_seq_len)
    sliding = [w for w in windows if w < max_seq_len]
    if len(sliding) == len(windows):  # every layer slides: priced at full length (see the module docstring)
        return CacheCost(len(windows) * per_layer)
    per_request = sum(math.ceil(w / tokens_per_block) * tokens_per_block * per_layer for w in sliding)
    prefill = max_num_tokens * len(sliding) * per_layer
    return CacheCost((len(windows) - len(sliding)) * per_layer, max_batch_size * per_request + prefill)
