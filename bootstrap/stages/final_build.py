"""Stage 7, ``final_build``: allocate the final KV pools from the budgets. OOM: the attempt's
pools are released, every budget shrinks by one step (10 %), retry."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bootstrap.backends.artifacts import FinalBuild, LoadedModel, ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import fmt_bytes
from bootstrap.capacity.split import PoolBudget, PoolBudgets
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Adaptation, GiveUp, Stage, on_oom
from bootstrap.pipeline.undo import Undo

SHRINK_STEP = 0.9


def final_build(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    budgets: PoolBudgets,
    backend: Backend,
    undo: Undo,
) -> FinalBuild:
    return backend.build_final(loaded, resolved, budgets, undo)


def shrink_budgets(exc: BaseException, inputs: Mapping[str, Any]) -> Adaptation:
    """Every pool 10 % smaller, as long as each still holds one request of ``max_seq_len``."""
    budgets: PoolBudgets = inputs["budgets"]
    tpb, max_seq_len = inputs["config"].tokens_per_block, inputs["resolved"].max_seq_len
    try:
        smaller = PoolBudgets(
            **{n: _shrink(getattr(budgets, n), tpb, max_seq_len) for n in ("target", "draft", "cross")}
        )
    except GiveUp as give_up:
        raise give_up from exc
    changes = {f"{p.name}_bytes": f"{p.gpu_bytes} -> {q.gpu_bytes}" for p, q in zip(budgets.pools(), smaller.pools())}
    return Adaptation({"budgets": smaller}, changes)


def _shrink(pool: PoolBudget | None, tokens_per_block: int, max_seq_len: int) -> PoolBudget | None:
    if pool is None:
        return None
    gpu = int(pool.gpu_bytes * SHRINK_STEP)
    tokens = pool.cost.tokens_for_budget(gpu) // tokens_per_block * tokens_per_block
    need = -(-max_seq_len // tokens_per_block) * tokens_per_block
    if tokens < need:
        raise GiveUp(
            f"the {pool.name} KV pool cannot shrink below {fmt_bytes(pool.gpu_bytes)}: "
            f"at {fmt_bytes(gpu)} it would hold {tokens} tokens, less than one request of "
            f"max_seq_len={max_seq_len}; lower max_seq_len or max_batch_size, or free device memory"
        )
    return dataclasses.replace(pool, gpu_bytes=gpu, tokens=tokens)


STAGE = Stage(
    "final_build",
    final_build,
    provides="final",
    retry=on_oom(attempts=3),
    adapt=shrink_budgets,
    oom_advice="The KV pools do not fit even after shrinking: lower free_gpu_memory_fraction, raise kv_headroom_bytes "
    "or set max_kv_bytes.",
    figures=lambda f: (
        {f"bootstrap.kv.pool_bytes.{k}": v for k, v in f.pool_bytes.items()}
        | {f"bootstrap.kv.pool_tokens.{k}": v for k, v in f.pool_tokens.items()}
    ),
)
