"""How the memory left after the measured peak is shared with the KV cache: TensorRT-LLM's
fraction, or everything but a headroom in bytes."""

from __future__ import annotations


def kv_share(left: int, fraction: float, headroom_bytes: int | None = None) -> int:
    """The KV cache's share of ``left`` bytes (memory left after the measured peak): TensorRT-LLM's
    ``int(left * free_gpu_memory_fraction)``, or, when ``headroom_bytes`` is given
    (``kv_headroom_bytes``), everything but that many bytes (never below 0)."""
    if headroom_bytes is None:
        return int(left * fraction)
    return max(left - headroom_bytes, 0)


def memory_rule(fraction: float, headroom_bytes: int | None = None) -> str:
    """The config field that shares memory with the KV cache, as error messages name it."""
    return f"free_gpu_memory_fraction {fraction}" if headroom_bytes is None else f"kv_headroom_bytes {headroom_bytes:,}"
