"""The native PyTorch inference engine: paged KV cache, paged attention for transformers models,
capacity and micro-batch scheduling, sampling, and the ``PyExecutor`` loop.

Names are exported lazily, so importing a light submodule (``bootstrap.engine.sampling``) does
not import transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVCacheFull": "kv_cache",
    "KVCacheSpec": "kv_cache",
    "KVCacheStats": "kv_cache",
    "PagedKVCache": "kv_cache",
    "ATTN_IMPLEMENTATION": "attention",
    "AttentionMetadata": "attention",
    "paged_attention": "attention",
    "use_metadata": "attention",
    "ModelRunner": "model_runner",
    "Sequence": "sequence",
    "SequenceStatus": "sequence",
    "CapacityScheduler": "scheduler",
    "MicroBatchScheduler": "scheduler",
    "ScheduledBatch": "scheduler",
    "Scheduler": "scheduler",
    "SchedulerConfig": "scheduler",
    "PyExecutor": "executor",
    "RequestInUse": "requests",
    "RequestStats": "requests",
    "Response": "sequence",
    "StreamEvent": "sequence",
    "create_executor": "create",
    "EngineStats": "stats",
    "load_model": "loader",
    "load_hf_config": "loader",
    "resolve_source": "loader",
    "ModelSourceError": "loader",
    "Sampler": "sampling",
    "SamplingParams": "sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bootstrap.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bootstrap.engine.{module}"), name)
