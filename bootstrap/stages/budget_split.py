"""Stage 6, ``budget_split``: pure; split the KV budget between the target, draft and cross
pools, and the host tier by slope."""

from __future__ import annotations

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.capacity import CapacityPlan
from bootstrap.capacity.split import PoolBudgets, split_budgets
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Stage


def budget_split(config: BootstrapConfig, resolved: ResolvedClasses, plan: CapacityPlan) -> PoolBudgets:
    return split_budgets(
        plan,
        target_cost=resolved.cost,
        draft_cost=resolved.draft_cost,
        cross_cost=resolved.cross_cost,
        cross_fraction=config.cross_kv_cache_fraction,
        host_bytes=config.host_cache_bytes,
    )


def _figures(budgets: PoolBudgets) -> dict[str, int]:
    out: dict[str, int] = {}
    for pool in budgets.pools():
        out[f"bootstrap.kv.{pool.name}_bytes"] = pool.gpu_bytes
        out[f"bootstrap.kv.{pool.name}_tokens"] = pool.tokens
    return out


STAGE = Stage("budget_split", budget_split, provides="budgets", blocking=False, figures=_figures)
