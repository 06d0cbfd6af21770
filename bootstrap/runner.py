"""Assemble a pipeline for a config and a backend, and describe its result."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import TracerProvider

from bootstrap.backends.base import Backend
from bootstrap.budget_split import PoolBudgets
from bootstrap.capacity import CapacityPlan
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import Pipeline
from bootstrap.plan_cache import PlanCache
from bootstrap.stage import Stage
from bootstrap.stages import DEFAULT_STAGES


def make_pipeline(
    config: BootstrapConfig,
    backend: Backend,
    *,
    tracer_provider: TracerProvider | None = None,
    stages: Sequence[Stage] = DEFAULT_STAGES,
) -> Pipeline:
    inputs = {
        "config": config,
        "backend": backend,
        "plan_cache": PlanCache(config.plan_cache) if config.plan_cache else None,
    }
    return Pipeline(stages, inputs, tracer_provider=tracer_provider, device=backend.device)


def plan_summary(artifacts: dict[str, Any]) -> dict[str, Any]:
    """The ``plan`` object of ``--json``: budget, tokens, concurrency, the profile it came from,
    and per-pool shares."""
    plan: CapacityPlan | None = artifacts.get("plan")
    if plan is None:
        return {}
    out = plan.to_dict()
    profile = artifacts.get("profile")
    if profile is not None:
        out["profile"] = profile.to_dict()
    budgets: PoolBudgets | None = artifacts.get("budgets")
    if budgets is not None:
        out["pools"] = budgets.to_dict()
        for pool in budgets.pools():
            out[f"{pool.name}_share"] = round(pool.gpu_bytes / plan.kv_budget_bytes, 6) if plan.kv_budget_bytes else 0.0
    return out
