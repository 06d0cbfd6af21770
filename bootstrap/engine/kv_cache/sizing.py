"""What sizes a paged KV pool (``KVCacheSpec``), what it reports (``KVCacheStats``), and the
zeroed tensor it is (``zeros``); the pool itself is ``kv_cache.pool``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy
import torch

from bootstrap.config import is_int


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one token over all layers: ``2 * layers * kv_heads * head_dim * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


class KVCacheFull(RuntimeError):
    """Not enough free blocks for an allocation; the message gives the figures."""


@dataclass(frozen=True)
class KVCacheSpec:
    """The per-token shape of a model's KV cache: what sizes the pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVCacheSpec.dtype must be a floating torch.dtype, got {self.dtype!r}")

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype, tp: int = 1) -> KVCacheSpec:
        """The spec of a transformers model config (its text config for multimodal models), on
        one of ``tp`` tensor-parallel ranks: each holds ``kv_heads / tp`` heads (the KV heads and
        the attention heads must divide evenly, as the TP plan splits them)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "kv_lora_rank", None):
            raise ValueError(
                f"{type(text).__name__} uses multi-head latent attention (kv_lora_rank="
                f"{text.kv_lora_rank}); the paged KV cache holds MHA/GQA/MQA keys and values only"
            )
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if not isinstance(tp, int) or tp < 1 or count % tp:
                raise ValueError(f"tensor_parallel_size {tp!r} must be an integer >= 1 that divides {name} ({count})")
        return cls(text.num_hidden_layers, kv_heads // tp, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class KVCacheStats:
    total_bytes: int
    used_bytes: int
    allocated_bytes: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    tokens_per_block: int
    used_tokens: int
    cached_blocks: int = 0
    cached_free_blocks: int = 0

    @property
    def capacity_tokens(self) -> int:
        return self.total_blocks * self.tokens_per_block


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on the CPU from ``calloc``-style memory (numpy), whose pages the kernel
    maps zeroed on first touch: a large pool costs no time to allocate and no resident memory
    until requests fill it, where ``torch.zeros`` writes every byte up front."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = numpy.zeros(shape, dtype=f"u{itemsize}")  # same bytes: all-zero bits are 0.0 in every float dtype
    return torch.from_numpy(raw).view(dtype)


def check_positive(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
