"""Stage 5, ``capacity``: pure arithmetic from the memory profile and the config to a KV byte
budget and token capacity. Infeasible plans raise ``CapacityError`` with the figures and the
knob to turn. It writes nothing: the plan cache's owner stores the plan once this stage has
succeeded (``api.make_pipeline``, ``PlanCache.remember_measured``)."""

from __future__ import annotations

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import CapacityPlan, MemoryProfile, plan_capacity
from bootstrap.capacity.agree import smallest_plan
from bootstrap.capacity.rules import describe_rule
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Stage


def capacity(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    profile: MemoryProfile,
    backend: Backend,
) -> CapacityPlan:
    """The plan under the run's memory rule (``bootstrap.capacity.rules``), the backend's
    headroom recomputed from the measured profile where that is the rule."""
    rule = resolved.memory_rule.with_backend_headroom(backend.default_headroom_bytes(profile, resolved, config))
    return plan_capacity(
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
