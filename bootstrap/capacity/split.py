"""Pure budget split: one KV byte budget -> target / draft / cross pools and host tiers.

Follows TensorRT-LLM (reference §3.5): the self/cross split runs first, then the draft split.
Deliberate differences from TensorRT-LLM:
- the GPU draft split always applies (TRT applies it only when its managers size from bytes,
  and otherwise lets target and draft share ``max_tokens``; a two-model V2 run even asserts
  equal, unsplit budgets). Splitting by cost keeps every pool's token capacity equal;
- the split is weighted by bytes per token only (TRT main after Sep 2026 weights by batch
  capacity, #18910);
- a pool that cannot hold one ``max_seq_len`` request is an error here, not at the first long
  request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bootstrap.capacity import CacheCost, CapacityError, CapacityPlan, fmt_bytes


def split_draft(budget: int, target: CacheCost, draft: CacheCost, *, on_gpu: bool = True) -> tuple[int, int]:
    """``(target_bytes, draft_bytes)``: ``draft = d.i + (B - t.i - d.i) * d.slope // (t.slope + d.slope)``.

    Off the GPU (host tiers) the intercepts are dropped and the split is by slope only. When the
    budget cannot cover both intercepts: on GPU a `CapacityError`, off GPU the draft gets 0.
    The two parts always sum to ``budget`` exactly.
    """
    if budget < 0:
        raise CapacityError(f"KV budget must be >= 0, got {fmt_bytes(budget)}")
    t_i, d_i = (target.intercept, draft.intercept) if on_gpu else (0, 0)
    var = budget - t_i - d_i
    slopes = target.slope + draft.slope
    if var < 0 or (var == 0 and slopes > 0):
        if not on_gpu:
            return budget, 0
        raise CapacityError(
            f"KV budget {fmt_bytes(budget)} cannot hold the fixed per-sequence state of the target "
            f"({fmt_bytes(t_i)}) and draft ({fmt_bytes(d_i)}) pools: lower max_batch_size, raise "
            "free_gpu_memory_fraction or max_kv_bytes"
        )
    draft_bytes = d_i + (var * draft.slope // slopes if slopes else 0)
    return budget - draft_bytes, draft_bytes


def split_cross(budget: int, fraction: float) -> tuple[int, int]:
    """``(self_bytes, cross_bytes)`` with ``cross = int(budget * cross_kv_cache_fraction)``."""
    if not 0 < fraction < 1:
        raise CapacityError(f"cross_kv_cache_fraction must be in (0, 1), got {fraction}")
    if budget < 0:
        raise CapacityError(f"KV budget must be >= 0, got {fmt_bytes(budget)}")
    cross = int(budget * fraction)
    return budget - cross, cross


@dataclass(frozen=True)
class PoolBudget:
    """One KV pool: its GPU and host bytes and GPU token capacity (block aligned)."""

    name: str
    gpu_bytes: int
    host_bytes: int
    tokens: int
    cost: CacheCost

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "tokens": self.tokens,
            "cost": {"slope": self.cost.slope, "intercept": self.cost.intercept},
        }


@dataclass(frozen=True)
class PoolBudgets:
    """Stage 6 output: the target pool, and the draft and cross pools where the model has them."""

    target: PoolBudget
    draft: PoolBudget | None = None
    cross: PoolBudget | None = None

    def pools(self) -> tuple[PoolBudget, ...]:
        return tuple(p for p in (self.target, self.draft, self.cross) if p is not None)

    def to_dict(self) -> dict[str, Any]:
        return {p.name: p.to_dict() for p in self.pools()}


def split_budgets(
    plan: CapacityPlan,
    *,
    target_cost: CacheCost,
    draft_cost: CacheCost | None = None,
    cross_cost: CacheCost | None = None,
    cross_fraction: float | None = None,
    host_bytes: int = 0,
) -> PoolBudgets:
    """Split ``plan.kv_budget_bytes`` (and ``host_bytes``): cross first, then draft.

    The pool costs must add up to ``plan.cost`` (the plan was sized for all pools together).
    """
    _check_costs(plan, target_cost, draft_cost, cross_cost)
    if host_bytes < 0:
        raise CapacityError(f"host_cache_bytes must be >= 0, got {host_bytes}")
    gpu, host = plan.kv_budget_bytes, host_bytes
    cross, knob = None, ""
    if cross_cost is not None:
        if cross_fraction is None:
            raise CapacityError("the model has cross attention: set cross_kv_cache_fraction")
        gpu, cross_gpu = split_cross(gpu, cross_fraction)
        host, cross_host = split_cross(host, cross_fraction)
        knob = ", or change cross_kv_cache_fraction"
        cross = _pool("cross", cross_gpu, cross_host, cross_cost, plan, knob)
    elif cross_fraction is not None:
        raise CapacityError("cross_kv_cache_fraction is set but the model has no cross attention: unset it")
    draft = None
    if draft_cost is not None:
        gpu, draft_gpu = split_draft(gpu, target_cost, draft_cost, on_gpu=True)
        host, draft_host = split_draft(host, target_cost, draft_cost, on_gpu=False)
        draft = _pool("draft", draft_gpu, draft_host, draft_cost, plan, knob)
    return PoolBudgets(target=_pool("target", gpu, host, target_cost, plan, knob), draft=draft, cross=cross)


def _check_costs(plan: CapacityPlan, *costs: CacheCost | None) -> None:
    total = CacheCost(0)
    for cost in costs:
        total = total + cost if cost is not None else total
    if total != plan.cost:
        raise ValueError(f"pool costs add up to {total}, but the plan was sized for {plan.cost}")


def _pool(
    name: str, gpu_bytes: int, host_bytes: int, cost: CacheCost, plan: CapacityPlan, extra_knob: str = ""
) -> PoolBudget:
    tpb = plan.tokens_per_block
    tokens = cost.tokens_for_budget(gpu_bytes) // tpb * tpb
    need = -(-plan.max_seq_len // tpb) * tpb
    if tokens < need:
        raise CapacityError(
            f"the {name} KV pool gets {fmt_bytes(gpu_bytes)}, {tokens:,} tokens, less than one request of "
            f"max_seq_len={plan.max_seq_len} ({fmt_bytes(cost.bytes_for_tokens(need))} needed): lower max_seq_len "
            "or max_batch_size, raise free_gpu_memory_fraction or max_kv_bytes" + extra_knob
        )
    return PoolBudget(name=name, gpu_bytes=gpu_bytes, host_bytes=host_bytes, tokens=tokens, cost=cost)
