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
