"""Pure capacity math: KV bytes per token, the probe size, and profile -> KV budget.

No torch import. The formulas follow TensorRT-LLM's PyTorch backend (see
``shared/reference/tensorrt-llm-executor-creation.md`` §3); where this module differs on
purpose, the docstring says so. Every infeasible case raises `CapacityError` with the figures
(GiB with two decimals and exact bytes) and the config field to change.

Modules: ``errors`` (the error and byte formatting), ``cost`` (KV bytes per token), ``rules``
(fraction or headroom), ``probe`` (the probe's size), ``plan`` (profile to plan). The budget
split between pools lives in `bootstrap.budget_split`.
"""

from __future__ import annotations

from bootstrap.capacity.cost import CacheCost, kv_dtype_bytes, mha_cost, mla_cost, model_cost, probe_cost
from bootstrap.capacity.errors import GIB, CapacityError, fmt_bytes
from bootstrap.capacity.plan import CapacityPlan, MemoryProfile, plan_capacity
from bootstrap.capacity.probe import cap_probe_tokens, dummy_request_lengths, dummy_workload_tokens, estimation_tokens
from bootstrap.capacity.rules import kv_share, memory_rule

__all__ = [
    "GIB", "CacheCost", "CapacityError", "CapacityPlan", "MemoryProfile",
    "cap_probe_tokens", "dummy_request_lengths", "dummy_workload_tokens", "estimation_tokens", "fmt_bytes",
    "kv_dtype_bytes", "kv_share", "memory_rule", "mha_cost", "mla_cost", "model_cost", "plan_capacity", "probe_cost",
]
