"""The ``plan`` object of a run (``--json``, the server's ``/v1/bootstrap``, the Python report),
read from the stages' artifacts."""

from __future__ import annotations

from typing import Any

from bootstrap.backends.artifacts import FinalBuild
from bootstrap.capacity import CapacityPlan
from bootstrap.capacity.quantization import WeightQuantization
from bootstrap.capacity.split import PoolBudgets


def plan_summary(artifacts: dict[str, Any]) -> dict[str, Any]:
    """The ``plan`` object of ``--json``: budget, tokens, concurrency, the profile it came from,
    per-pool shares, and whether prefixes are cached. Once ``final_build`` ran, the figures are
    what it allocated (a retry may have shrunk the pools); ``planned_kv_budget_bytes`` keeps what
    ``capacity`` planned."""
    plan: CapacityPlan | None = artifacts.get("plan")
    if plan is None:
        return {}
    out = plan.to_dict()
    out["planned_kv_budget_bytes"] = plan.kv_budget_bytes
    config = artifacts.get("config")
    if config is not None:
        out["prefix_caching"] = config.prefix_caching
    resolved = artifacts.get("resolved")
    if resolved is not None:
        out["weights"] = weights_summary(resolved.dtype, resolved.shape.quantization)
        out["kv_dtype"] = resolved.kv_dtype
    profile = artifacts.get("profile")
    if profile is not None:
        out["profile"] = profile.to_dict()
    budgets: PoolBudgets | None = artifacts.get("budgets")
    if budgets is not None:
        out["pools"] = budgets.to_dict()
    final: FinalBuild | None = artifacts.get("final")
    if final is not None:
        out.update(_allocated(out, plan, final))
        if final.kv_scales is not None:
            out["kv_scales"] = final.kv_scales.source  # an fp8 pool's, as new weights may have changed them
    warmup = artifacts.get("warmup")
    if warmup is not None and warmup.num_graphs:
        out["cuda_graphs"] = {
            "graphs": warmup.num_graphs,
            "batch_sizes": list(warmup.batch_sizes),
            "widths": list(warmup.widths),
            "graph_bytes": warmup.graph_bytes,
            "reserved_bytes": warmup.reserved_bytes,
            "capture_s": round(warmup.capture_s, 3),
        }
    for name, pool in out.get("pools", {}).items():
        out[f"{name}_share"] = round(pool["gpu_bytes"] / out["kv_budget_bytes"], 6) if out["kv_budget_bytes"] else 0.0
    return out


def weights_summary(dtype: str, quantization: WeightQuantization | None) -> dict[str, Any]:
    """The weights' dtype and quantization: ``method`` (``fp8-at-load`` for ``--quantization
    fp8``, else the checkpoint's ``quant_method``) and ``strategy`` (its scales), or None."""
    method = quantization.method if quantization is not None else None
    strategy = quantization.strategy if quantization is not None else None
    return {"dtype": dtype, "quantization": method, "strategy": strategy}


def _allocated(out: dict[str, Any], plan: CapacityPlan, final: FinalBuild) -> dict[str, Any]:
    tokens = final.pool_tokens.get("target", plan.kv_tokens)
    kv_requests = tokens // plan.tokens_per_block // -(-plan.max_seq_len // plan.tokens_per_block)
    pools = {
        name: {**pool, "gpu_bytes": final.pool_bytes[name], "tokens": final.pool_tokens[name]}
        for name, pool in out.get("pools", {}).items()
        if name in final.pool_bytes
    }
    return {
        "kv_budget_bytes": sum(final.pool_bytes.values()),
        "kv_tokens": tokens,
        "kv_blocks": tokens // plan.tokens_per_block,
        "kv_requests": kv_requests,
        "max_concurrent_requests": min(kv_requests, plan.max_batch_size),
        "pools": pools,
    }
