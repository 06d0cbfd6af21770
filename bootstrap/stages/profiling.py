"""Stage 4, ``profiling``: dummy requests filling ``max_num_tokens`` through the probe executor;
measure model bytes, torch peak, non-torch memory and probe KV bytes; the probe is torn down
once this succeeds. OOM (``shrink``): the probe is torn down and rebuilt smaller within the next
attempt, first to the dummy workload of the same ``max_num_tokens``, then with ``max_num_tokens``
halved (the plan records the value that ran); nothing left to change fails at once.

Why the rebuild happens here rather than by rerunning ``estimation_build``: the probe's only job is
to let the forward run, and the failed forward is what says it must shrink, so the stage that
measures owns the resize; a stage retries only itself, and the estimation artifact stays the
pipeline's (released when profiling consumes it, idempotently)."""

from __future__ import annotations

from bootstrap.backends.artifacts import EstimationBuild, LoadedModel, ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import MemoryProfile
from bootstrap.capacity.agree import conservative_profile
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Skip, Stage, on_oom
from bootstrap.pipeline.undo import Undo
from bootstrap.stages.estimation_build import build_probe
from bootstrap.stages.plan_cache import PlanCache
from bootstrap.stages.shrink import effective_max_num_tokens, probe_oom, shrink_probe_or_workload


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
    probe_tokens: int | None = None,
) -> MemoryProfile:
    """``probe_tokens``, set by the OOM adaptation: profile on a probe rebuilt at that size. The
    probe is rebuilt too when it is gone (an earlier run's attempt released it; ``retry()``)."""
    max_num_tokens = effective_max_num_tokens(config, estimation)
    if probe_tokens is None and _is_live(estimation):
        return _measure(backend, estimation, loaded, max_num_tokens, config, undo)
    if estimation.release is not None:
        estimation.release.run()  # the probe sized for the workload that failed
    config = config.model_copy(update={"max_num_tokens": max_num_tokens})
    rebuilt = build_probe(config, resolved, loaded, backend, probe_tokens or estimation.probe_tokens, undo)
    profile = _measure(backend, rebuilt, loaded, max_num_tokens, config, undo)
    rebuilt.release.run()  # torn down here, as consuming the original probe would
    return profile


def _measure(
    backend: Backend,
    probe: EstimationBuild,
    loaded: LoadedModel,
    max_num_tokens: int,
    config: BootstrapConfig,
    undo: Undo,
) -> MemoryProfile:
    with probe_oom("the dummy forward", max_num_tokens=max_num_tokens, probe_tokens=probe.probe_tokens):
        return backend.profile(probe, loaded, max_num_tokens, config, undo)


def _is_live(estimation: EstimationBuild) -> bool:
    return estimation.release is None or len(estimation.release) > 0


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
    adapt=shrink_probe_or_workload,
    skip=skip_with_cached_profile,
    consumes=("estimation",),
    agree=conservative_profile,  # several ranks: max peak, min free, ... (bootstrap.capacity.agree)
    oom_advice=(
        "The dummy forward does not fit even after the retries shrank the probe and halved max_num_tokens "
        "(each attempt's span records the change): start with max_num_tokens below the value above, lower "
        "max_batch_size or max_seq_len, or free device memory."
    ),
    figures=lambda p: {
        "bootstrap.memory.peak_bytes": p.peak_bytes,
        "bootstrap.memory.model_bytes": p.model_bytes,
        "bootstrap.memory.torch_peak_bytes": p.torch_peak_bytes,
        "bootstrap.memory.activation_bytes": p.activation_bytes,
        "bootstrap.memory.probe_kv_bytes": p.probe_kv_bytes,
        "bootstrap.max_num_tokens": p.max_num_tokens,
    },
)
