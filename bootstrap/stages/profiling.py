"""Stage 4, ``profiling``: dummy requests filling ``max_num_tokens`` through the probe executor;
measure model bytes, torch peak, non-torch memory and probe KV bytes; the probe is torn down
once this succeeds. OOM: halve ``max_num_tokens`` (the plan records the value that ran), retry."""

from __future__ import annotations

from bootstrap.artifacts import EstimationBuild, LoadedModel, ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import MemoryProfile
from bootstrap.config import BootstrapConfig
from bootstrap.plan_cache import PlanCache
from bootstrap.stage import Skip, Stage, on_oom
from bootstrap.stages.shrink import effective_max_num_tokens, halve_max_num_tokens
from bootstrap.undo import Undo


class PlanCacheMiss(RuntimeError):
    """The probe was skipped for a cached plan that is gone now."""


def profiling(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    estimation: EstimationBuild | None,
    backend: Backend,
    plan_cache: PlanCache | None,
    undo: Undo,
) -> MemoryProfile:
    max_num_tokens = effective_max_num_tokens(config, estimation)
    return backend.profile(estimation, loaded, max_num_tokens, config, undo)


def skip_with_cached_profile(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    estimation: EstimationBuild | None,
    backend: Backend,
    plan_cache: PlanCache | None,
) -> Skip | None:
    """When the probe was skipped for a cached plan, its profile stands in for a measurement."""
    if estimation is not None:
        return None
    cached = plan_cache.lookup(config, resolved, backend) if plan_cache else None
    if cached is None:
        raise PlanCacheMiss("the cached plan disappeared between estimation_build and profiling; start again")
    return Skip(cached.profile, "plan-cache")


STAGE = Stage(
    "profiling",
    profiling,
    provides="profile",
    retry=on_oom(attempts=3),
    adapt=halve_max_num_tokens,
    skip=skip_with_cached_profile,
    consumes=("estimation",),
    oom_advice="The dummy forward does not fit: lower max_num_tokens or max_batch_size.",
    figures=lambda p: {
        "bootstrap.memory.peak_bytes": p.peak_bytes,
        "bootstrap.memory.model_bytes": p.model_bytes,
        "bootstrap.memory.torch_peak_bytes": p.torch_peak_bytes,
        "bootstrap.memory.activation_bytes": p.activation_bytes,
        "bootstrap.memory.probe_kv_bytes": p.probe_kv_bytes,
        "bootstrap.max_num_tokens": p.max_num_tokens,
    },
)
