"""Stage 8, ``scheduler_sampler``: create the scheduler (capacity + micro-batch) and the
sampler, wire and start the executor, serve one smoke request. No retry: a started executor
is not retry-safe; a failure shuts it down (rollback) and fails the stage."""

from __future__ import annotations

from typing import Any

from bootstrap.backends.artifacts import FinalBuild, LoadedModel, ResolvedClasses, Warmup
from bootstrap.backends.base import Backend
from bootstrap.capacity import CapacityPlan
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Stage
from bootstrap.pipeline.undo import Undo


def scheduler_sampler(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    final: FinalBuild,
    plan: CapacityPlan,
    warmup: Warmup,
    backend: Backend,
    undo: Undo,
) -> Any:
    """A backend that captured something in ``warmup`` gets it (``warmup=``); others never see it."""
    extra = {"warmup": warmup} if warmup.handle is not None else {}
    return backend.start_executor(loaded, resolved, final, plan, config, undo, **extra)


STAGE = Stage(
    "scheduler_sampler",
    scheduler_sampler,
    provides="executor",
    oom_advice="The executor state does not fit beside the KV pools: lower max_batch_size or free_gpu_memory_fraction.",
)
