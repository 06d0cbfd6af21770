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
from bootstrap.capacity.rules import describe_rule
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
    """The plan under the run's memory rule (``bootstrap.capacity.rules``), the backend's
    headroom recomputed from the measured profile where that is the rule."""
    rule = resolved.memory_rule.with_backend_headroom(backend.default_headroom_bytes(profile, resolved, config))
    plan = plan_capacity(
        profile,
        cost=resolved.total_cost,
        fraction=rule.fraction,
        max_seq_len=resolved.max_seq_len,
        max_batch_size=config.max_batch_size,
        tokens_per_block=config.tokens_per_block,
        max_kv_bytes=config.max_kv_bytes,
        max_kv_tokens=config.max_kv_tokens,
        caps=backend.kv_caps(resolved, config),
        headroom_bytes=rule.headroom_bytes,
        rule_source=rule.source,
    )
    if plan_cache is not None and profile.max_num_tokens == config.max_num_tokens:
        remember(plan_cache, config, resolved, backend, profile, plan)
    return plan


def remember(
    plan_cache: PlanCache,
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    backend: Backend,
    profile: MemoryProfile,
    plan: CapacityPlan,
) -> None:
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
        "bootstrap.memory_rule": describe_rule(p.rule_source, p.fraction, p.headroom_bytes),
        "bootstrap.memory_rule.source": p.rule_source,
        "bootstrap.max_num_tokens": p.max_num_tokens,
    },
)
