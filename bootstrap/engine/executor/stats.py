"""``EngineStats``: the engine's load at one moment, as ``PyExecutor.engine_stats`` reports it
(the KV pool and the requests), for the server's ``/metrics`` and anyone else on another thread."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds at one moment: its KV pool and its requests. ``waiting`` counts the
    requests queued for admission, those still in the inbox included."""

    kv_total_blocks: int
    kv_used_blocks: int
    kv_capacity_tokens: int
    running: int
    waiting: int
    draft_tokens_proposed: int = 0  # speculative decoding: draft tokens the target verified
    draft_tokens_accepted: int = 0  # and kept
    prefix_caching: bool = False  # whether admitted requests look their prompts up in the cache
    kv_cached_blocks: int = 0  # blocks holding a cached prefix (held or not)
    kv_cached_free_blocks: int = 0  # of them, those no request holds (free capacity, counted in it)
    prefix_query_tokens: int = 0  # prompt tokens looked up, since the engine started
    prefix_hit_tokens: int = 0  # of them, found cached
    kv_dtype: str = ""  # the pool's: float32, bfloat16, float16 or fp8
    overlap: bool = False  # whether steps launch before the last one's tokens are read (``executor.overlap``)

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hit tokens over looked-up tokens; None before any lookup."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None
