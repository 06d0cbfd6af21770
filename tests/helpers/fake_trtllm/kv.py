"""Fake KV cache managers, transcribed from TensorRT-LLM's source (2026 main):

- ``KVCacheManager`` (V1, resource_manager.py): estimation managers get
  ``max_tokens // tokens_per_block`` blocks for every window; otherwise
  ``calculate_max_num_blocks`` asserts ``free_gpu_memory_fraction < 1.0`` and takes
  ``min(max_tokens, fraction * free / bytes_per_token)``; VSWA (two or more windows) uses
  ``calculate_max_num_blocks_for_vswa``: ``max_gpu_total_bytes`` (else ``free * fraction``)
  shared equally between window sizes. Secondary (host) blocks are
  ``host_cache_size // bytes_per_token // tokens_per_block``, host memory (not on the device).
  Bytes per token use ``ceil(kv_heads / tp)`` heads, as the manager's constructor does.
- ``KVCacheManagerV2`` (kv_cache/kv_cache_manager_v2.py): quota ``max_gpu_total_bytes``,
  ``min``'d with ``ceil(quota_from_max_tokens(max_tokens) / max_util_for_resume)``; asserts a
  quota is set; ``allocated_bytes`` is the quota; capacity from ``_get_max_tokens_from_quota``.
- the static per-token costs the creator prices with: V1 ``2 * L * (head_dim * kv_heads // tp)
  * dtype`` (all layers), V2 ``(full layers, max_batch_size * sum(ceil(w/tpb)*tpb*layer))``.
Pools are allocated at construction (``trtllm/kv/<probe|final>/<target|draft>``) and freed by
``shutdown()`` (idempotent, like ``release_pools``) or when the manager is collected.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from helpers.fake_trtllm import checked, export


@export("ResourceManagerType")
class ResourceManagerType(enum.Enum):
    KV_CACHE_MANAGER = "KV_CACHE_MANAGER"
    DRAFT_KV_CACHE_MANAGER = "DRAFT_KV_CACHE_MANAGER"
    PEFT_CACHE_MANAGER = "PEFT_CACHE_MANAGER"
    SEQ_SLOT_MANAGER = "SEQ_SLOT_MANAGER"
    SPEC_RESOURCE_MANAGER = "SPEC_RESOURCE_MANAGER"


@dataclass
class KvCacheStats:
    allocated_bytes: int = 0
    max_num_blocks: int = 0
    tokens_per_block: int = 0
    num_free_blocks_per_window_size: dict[int, int] = field(default_factory=dict)


def kv_dtype_bytes(kv_config: Any, engine: Any) -> int:
    return 1 if kv_config.dtype == "fp8" else engine.dtype_bytes


def layer_bytes(engine: Any, kv_config: Any, *, floor_heads: bool) -> int:
    """One attention layer, one token, one rank. ``floor_heads``: the static cost's
    ``head_dim * kv_heads // tp``; else the manager's ``ceil(kv_heads / tp)`` heads."""
    shape, tp, dtype = engine.shape, engine.mapping.tp_size, kv_dtype_bytes(kv_config, engine)
    if shape.kv_lora_rank is not None:  # MLA: SELFKONLY, one latent "head", no TP split
        return (shape.kv_lora_rank + shape.qk_rope_head_dim) * dtype
    per_rank = (
        shape.head_dim * shape.num_kv_heads // tp if floor_heads else -(-shape.num_kv_heads // tp) * shape.head_dim
    )
    return 2 * per_rank * dtype


def layer_windows(engine: Any, kv_config: Any, max_seq_len: int) -> list[int]:
    """``max_attention_window`` as a repeating per-layer pattern, clamped to ``max_seq_len``."""
    pattern = kv_config.max_attention_window or [max_seq_len]
    layers = engine.shape.num_attention_layers
    return [min(pattern[i % len(pattern)], max_seq_len) for i in range(layers)]


def static_cost(
    manager_cls: type, engine: Any, kv_config: Any, *, max_seq_len: int, max_batch_size: int
) -> tuple[int, int]:
    per_layer = layer_bytes(engine, kv_config, floor_heads=True)
    windows = layer_windows(engine, kv_config, max_seq_len)
    if not getattr(manager_cls, "IS_V2", False):
        return len(windows) * per_layer, 0
    tpb = kv_config.tokens_per_block
    sliding = [w for w in windows if w != max_seq_len]
    per_request = sum(math.ceil(w / tpb) * tpb * per_layer for w in sliding)
    return (len(windows) - len(sliding)) * per_layer, per_request * max_batch_size


class _Manager:
    IS_V2 = False

    def __init__(
        self,
        kv_config: Any,
        engine: Any,
        *,
        max_seq_len: int,
        max_batch_size: int,
        max_num_tokens: int,
        estimating: bool,
    ) -> None:
        self.kv_config, self.engine, self.estimating = kv_config, engine, estimating
        self.max_seq_len, self.max_batch_size, self.max_num_tokens = max_seq_len, max_batch_size, max_num_tokens
        self.tokens_per_block = kv_config.tokens_per_block
        self.windows = layer_windows(engine, kv_config, max_seq_len)
        self.layer_bytes = layer_bytes(engine, kv_config, floor_heads=False)
        self.blocks_per_window, nbytes = self._size()
        stage = "probe" if estimating else "final"
        self._pool = self._trt.allocate(
            nbytes, f"trtllm/kv/{stage}/{'draft' if engine.is_draft_model else 'target'}", self
        )
        self.used_blocks = 0

    def group_bytes(self, window: int) -> int:
        return Counter(self.windows)[window] * self.layer_bytes

    def get_cache_bytes_per_token(self) -> int:
        return len(self.windows) * self.layer_bytes

    @checked("KVCacheManager.get_kv_cache_stats")
    def get_kv_cache_stats(self) -> KvCacheStats:
        return KvCacheStats(
            allocated_bytes=self._pool.nbytes if self._pool.live else 0,
            max_num_blocks=sum(self.blocks_per_window.values()),
            tokens_per_block=self.tokens_per_block,
            num_free_blocks_per_window_size=dict(self.blocks_per_window),
        )

    def shutdown(self) -> None:
        self._pool.release()

    def full_length_tokens(self) -> int:
        return self.blocks_per_window[max(self.blocks_per_window)] * self.tokens_per_block

    def admit(self, tokens: int) -> bool:
        """A context request of ``tokens`` gets its blocks, or not (the scheduler's view)."""
        need = -(-tokens // self.tokens_per_block)
        if not self._pool.live or self.used_blocks + need > self.full_length_tokens() // self.tokens_per_block:
            return False
        self.used_blocks += need
        return True

    def free(self, tokens: int) -> None:
        self.used_blocks -= -(-tokens // self.tokens_per_block)


@export("fake:KVCacheManager")
class KVCacheManager(_Manager):
    def _size(self) -> tuple[dict[int, int], int]:
        cfg, tpb, groups = self.kv_config, self.tokens_per_block, sorted(set(self.windows))
        if self.estimating:
            blocks = int(cfg.max_tokens // tpb)
            return dict.fromkeys(groups, blocks), sum(blocks * tpb * self.group_bytes(w) for w in groups)
        fraction = cfg.free_gpu_memory_fraction if cfg.free_gpu_memory_fraction is not None else 0.9
        free = self._trt.device.free_bytes()
        if len(groups) > 1:  # calculate_max_num_blocks_for_vswa, default equal shares
            primary = cfg.max_gpu_total_bytes if cfg.max_gpu_total_bytes > 0 else int(free * fraction)
            blocks = {w: int(primary / len(groups) / self.group_bytes(w) // tpb) for w in groups}
        else:  # calculate_max_num_blocks
            assert fraction < 1.0, f"Invalid freeMemFraction, freeMemFraction {fraction} must be smaller than 1.0"
            tokens = fraction * free / self.get_cache_bytes_per_token()
            if cfg.max_tokens is not None:
                tokens = min(cfg.max_tokens, tokens)
            blocks = {groups[0]: int(tokens // tpb)}
        return blocks, sum(b * tpb * self.group_bytes(w) for w, b in blocks.items())

    def host_blocks(self) -> int:
        return (self.kv_config.host_cache_size or 0) // self.get_cache_bytes_per_token() // self.tokens_per_block


@export("fake:KVCacheManagerV2")
class KVCacheManagerV2(_Manager):
    IS_V2 = True

    def _size(self) -> tuple[dict[int, int], int]:
        cfg = self.kv_config
        quota = cfg.max_gpu_total_bytes if cfg.max_gpu_total_bytes and cfg.max_gpu_total_bytes > 0 else math.inf
        if cfg.max_tokens is not None:
            quota = min(quota, math.ceil(self.quota_from_max_tokens(cfg.max_tokens) / cfg.max_util_for_resume))
        assert quota != math.inf, (
            "Quota not set. Check kv_cache_config.max_tokens or kv_cache_config.max_gpu_total_bytes"
        )
        tokens = self.max_tokens_from_quota(quota)
        blocks = {self.max_seq_len: int(tokens // self.tokens_per_block)}
        for window in set(self.windows) - {self.max_seq_len}:
            blocks[window] = self.max_batch_size * math.ceil(window / self.tokens_per_block)
        return blocks, int(quota)

    def _swa_terms(self) -> tuple[int, int, int]:
        """(full bytes/token, context SWA bytes/token, generation SWA bytes/request)."""
        tpb, full, ctx, req = self.tokens_per_block, 0, 0, 0
        for window in self.windows:
            if window == self.max_seq_len:
                full += self.layer_bytes
            else:
                ctx += self.layer_bytes
                req += math.ceil(window / tpb) * tpb * self.layer_bytes
        return full, ctx, req

    def quota_from_max_tokens(self, max_tokens: int) -> int:
        full, ctx, req = self._swa_terms()
        context = min(max_tokens, self.max_num_tokens)
        return int(max_tokens * full + self.max_batch_size * req + context * ctx)

    def max_tokens_from_quota(self, quota: int) -> float:
        full, ctx, req = self._swa_terms()
        per_batch = self.max_batch_size * req
        if quota < per_batch:
            return 0
        context_limit = self.max_num_tokens * (full + ctx) + per_batch
        if quota <= context_limit:
            return math.inf if full + ctx <= 0 else (quota - per_batch) / (full + ctx)
        return math.inf if full <= 0 else self.max_num_tokens + (quota - context_limit) / full
