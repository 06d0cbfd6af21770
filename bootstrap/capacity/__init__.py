"""Pure capacity math: KV bytes per token, the probe size, and profile -> KV budget.

No torch import. The formulas follow TensorRT-LLM's PyTorch backend (see
``docs/reference/tensorrt-llm-executor-creation.md`` §3, "reference §" in docstrings); where this module differs on
purpose, the docstring says so. Every infeasible case raises `CapacityError` with the figures
(GiB with two decimals and exact bytes) and the config field to change.

Modules: ``shape`` (a model as capacity sees it), ``config_json`` (config.json to a shape),
``presets`` (real configs by name), ``errors`` (the error and byte formatting), ``cost`` (KV bytes
per token), ``pricing`` (as each backend's KV manager counts them), ``rules`` (the memory rule),
``probe`` (the probe's size), ``plan`` (profile to plan), ``split`` (the budget between target,
draft and cross pools, and the host tier), ``agree`` (what ranks agree on), ``cuda_graph_buckets``
(the batch sizes and widths the warmup stage captures).
"""

from __future__ import annotations

from bootstrap.capacity.cost import CacheCost, kv_dtype_bytes, mha_cost, mla_cost, model_cost, probe_cost
from bootstrap.capacity.errors import GIB, CapacityError, fmt_bytes
from bootstrap.capacity.plan import CapacityPlan, MemoryProfile, plan_capacity
from bootstrap.capacity.probe import cap_probe_tokens, dummy_request_lengths, dummy_workload_tokens, estimation_tokens
from bootstrap.capacity.rules import kv_share, memory_rule

__all__ = [
    "GIB",
    "CacheCost",
    "CapacityError",
    "CapacityPlan",
    "MemoryProfile",
    "cap_probe_tokens",
    "dummy_request_lengths",
    "dummy_workload_tokens",
    "estimation_tokens",
    "fmt_bytes",
    "kv_dtype_bytes",
    "kv_share",
    "memory_rule",
    "mha_cost",
    "mla_cost",
    "model_cost",
    "plan_capacity",
    "probe_cost",
]
