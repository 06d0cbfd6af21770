"""Stage 3, ``estimation_build``: probe KV pools sized for the dummy workload, and a temporary
executor on them; the probe is capped to what the free memory holds. OOM: the attempt's pools
are released, ``max_num_tokens`` halves, retry.
Skipped (reason ``plan-cache``) when a cached plan matches and the device has room for it."""

from __future__ import annotations

from bootstrap.artifacts import EstimationBuild, LoadedModel, ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import cap_probe_tokens, estimation_tokens
from bootstrap.config import BootstrapConfig
from bootstrap.plan_cache import CachedPlan, PlanCache
from bootstrap.stage import Skip, Stage, on_oom
from bootstrap.stages.shrink import halve_max_num_tokens
from bootstrap.undo import Undo


def estimation_build(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    backend: Backend,
    plan_cache: PlanCache | None,
    undo: Undo,
) -> EstimationBuild:
    wanted = estimation_tokens(
        max_num_tokens=config.max_num_tokens,
        max_seq_len=resolved.max_seq_len,
        max_batch_size=config.max_batch_size,
        tokens_per_block=config.tokens_per_block,
    )
    probe_tokens = cap_probe_tokens(
        wanted,
        cost=resolved.total_cost,
        free_bytes=backend.device.free_bytes(),
        fraction=config.free_gpu_memory_fraction,
        tokens_per_block=config.tokens_per_block,
    )
    return backend.build_estimation(loaded, resolved, probe_tokens, config, undo)


def cached_plan(
    config: BootstrapConfig, resolved: ResolvedClasses, loaded: LoadedModel, backend: Backend, plan_cache: PlanCache | None
) -> CachedPlan | None:
    """The cached plan for this exact setup, if there is one and the device has room for it now."""
    if plan_cache is None:
        return None
    cached = plan_cache.lookup(config, resolved, backend)
    fits = cached is not None and cached.fits(backend.device.free_bytes(), loaded.weight_bytes)
    return cached if fits else None


def skip_if_cached(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    backend: Backend,
    plan_cache: PlanCache | None,
) -> Skip | None:
    return Skip(None, "plan-cache") if cached_plan(config, resolved, loaded, backend, plan_cache) else None


STAGE = Stage(
    "estimation_build",
    estimation_build,
    provides="estimation",
    retry=on_oom(attempts=3),
    adapt=halve_max_num_tokens,
    skip=skip_if_cached,
    oom_advice="The probe KV pool does not fit: lower max_num_tokens, max_batch_size or max_seq_len.",
    figures=lambda e: {
        "bootstrap.kv.probe_tokens": e.probe_tokens,
        "bootstrap.kv.probe_bytes": e.probe_kv_bytes,
        "bootstrap.max_num_tokens": e.max_num_tokens,
    },
)
