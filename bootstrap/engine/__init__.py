"""The native PyTorch inference engine: paged KV cache, paged attention for transformers models,
capacity and micro-batch scheduling, sampling, and the ``PyExecutor`` loop.

Names are exported lazily, so importing a light submodule (``bootstrap.engine.sampling.sampler``) does
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
    "ATTN_IMPLEMENTATION": "layers.attention",
    "AttentionMetadata": "layers.attention",
    "paged_attention": "layers.attention",
    "use_metadata": "layers.attention",
    "ModelRunner": "step.runner",
    "Sequence": "request.sequence",
    "SequenceStatus": "request.sequence",
    "CapacityScheduler": "scheduler",
    "MicroBatchScheduler": "scheduler",
    "ScheduledBatch": "step.batch",
    "Scheduler": "scheduler",
    "SchedulerConfig": "scheduler",
    "PyExecutor": "executor.py_executor",
    "RequestInUse": "executor.request_table",
    "RequestStats": "executor.request_table",
    "Response": "request.sequence",
    "StreamEvent": "request.sequence",
    "create_executor": "executor.create",
    "EngineStats": "executor.stats",
    "load_model": "sources.loader",
    "load_hf_config": "sources.loader",
    "resolve_source": "sources.loader",
    "ModelSourceError": "sources.loader",
    "Sampler": "sampling.sampler",
    "SamplingParams": "sampling.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bootstrap.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bootstrap.engine.{module}"), name)
