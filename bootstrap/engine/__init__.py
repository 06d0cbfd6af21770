"""The native PyTorch inference engine, in rooms whose imports go down ``ENGINE_ALLOWED``
(``tests/unit/test_layout.py``): ``executor`` (``PyExecutor`` and its loop), ``spec``
(speculative decoding), ``scheduler``, ``step`` (one forward, its CUDA graphs), ``request``,
``sampling``, ``sources`` (where weights come from), ``models`` and ``layers`` (the own model
code), ``kernels`` (Triton), ``kv_cache`` (the paged pool) and ``tokenizer``.

Names are exported lazily, so importing a light submodule (``bootstrap.engine.sampling.sampler``)
does not import transformers.
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
    "ModelRunner": "step.model_runner",
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
