"""Stage 5, ``capacity``: pure arithmetic from the memory profile and the config to a KV byte
budget and token capacity. Infeasible plans raise ``CapacityError`` with the figures and the
knob to turn. A measured profile is stored in the plan cache here, unless a retry lowered
``max_num_tokens`` (one transient OOM must not halve every later start)."""

from __future__ import annotations

import logging

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import CapacityPlan, MemoryProfile, plan_capacity
from bootstrap.capacity.agree import smallest_plan
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Stage
from bootstrap.stages.plan_cache import PlanCache

log = logging.getLogger(__name__)


def capacity(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    profile: MemoryProfile,
    backend: Backend,
    plan_cache: PlanCache | None,
) -> CapacityPlan:
    """The plan under the config's memory rule (``memory_rule``)."""
    plan = plan_capacity(
        profile,
        cost=resolved.total_cost,
        fraction=config.free_gpu_memory_fraction,
        max_seq_len=resolved.max_seq_len,
        max_batch_size=config.max_batch_size,
        tokens_per_block=config.tokens_per_block,
        max_kv_bytes=config.max_kv_bytes,
        max_kv_tokens=config.max_kv_tokens,
        caps=backend.kv_caps(resolved, config),
        headroom_bytes=memory_rule(config, resolved, profile, backend),
    )
    if plan_cache is not None and profile.max_num_tokens == config.max_num_tokens:
        remember(plan_cache, config, resolved, backend, profile, plan)
    return plan


def memory_rule(config: BootstrapConfig, resolved: ResolvedClasses, profile: MemoryProfile,
                backend: Backend) -> int | None:  # fmt: skip
    """The headroom the plan keeps free beyond the peak, or None for TensorRT-LLM's fraction rule:
    ``kv_headroom_bytes`` when given; the fraction when ``free_gpu_memory_fraction`` is given
    (TensorRT-LLM's semantics, kept behind its own field); else the backend's default headroom,
    where it knows one (``Backend.default_headroom_bytes``), else the fraction's default, 0.9."""
    if config.kv_headroom_bytes is not None:
        return config.kv_headroom_bytes
    if "free_gpu_memory_fraction" in config.model_fields_set:
        return None
    return backend.default_headroom_bytes(profile, resolved, config)


def remember(
    plan_cache: PlanCache, config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend,
    profile: MemoryProfile, plan: CapacityPlan,
) -> None:  # fmt: skip
    """Store the plan; a failure to write costs the next start a profiling run, not this start."""
    try:
        plan_cache.remember(config, resolved, backend, profile, plan)
    except OSError as exc:
        log.warning("plan cache: could not store the plan in %s: %s", plan_cache.directory, exc)


STAGE = Stage(
    "capacity",
    capacity,
    provides="plan",
    blocking=False,
    agree=smallest_plan,  # several ranks: the smallest budget (bootstrap.capacity.agree)
    figures=lambda p: {
        "bootstrap.kv.budget_bytes": p.kv_budget_bytes,
        "bootstrap.kv.max_tokens": p.kv_tokens,
        "bootstrap.kv.max_concurrent_requests": p.max_concurrent_requests,
        "bootstrap.kv.limited_by": p.limited_by,
        "bootstrap.max_num_tokens": p.max_num_tokens,
    },
)
