"""Stage 3, ``estimation_build``: probe KV pools sized for the dummy workload, and a temporary
executor on them. The probe is TensorRT-LLM's estimation size capped by ``max_kv_tokens`` and by
what the memory rule (``bootstrap.capacity.rules``) gives of the free memory once the executor state beside it
(``Backend.estimation_overhead_bytes``) is allocated. OOM: the attempt's pools are released and
the probe shrinks, first to the dummy workload, then with ``max_num_tokens`` halved (``shrink``).
Skipped (reason ``plan-cache``) when a cached plan matches and the device has room for it, not
much more than when it was measured (``plan_cache.CachedPlan.much_more_room``)."""

from __future__ import annotations

import dataclasses

from opentelemetry import trace

from bootstrap.backends.artifacts import EstimationBuild, LoadedModel, ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.capacity import cap_probe_tokens, estimation_tokens, fmt_bytes
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Skip, Stage, on_oom
from bootstrap.pipeline.undo import Undo
from bootstrap.stages.plan_cache import CachedPlan, PlanCache
from bootstrap.stages.shrink import probe_oom, shrink_probe


def estimation_build(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    backend: Backend,
    plan_cache: PlanCache | None,
    undo: Undo,
    probe_tokens: int | None = None,
) -> EstimationBuild:
    """``probe_tokens``: the size an OOM adaptation chose (still capped); None, the estimation formula."""
    if probe_tokens is None:
        probe_tokens = estimation_tokens(
            max_num_tokens=config.max_num_tokens,
            max_seq_len=resolved.max_seq_len,
            max_batch_size=config.max_batch_size,
            tokens_per_block=config.tokens_per_block,
        )
    return build_probe(config, resolved, loaded, backend, probe_tokens, undo)


def build_probe(
    config: BootstrapConfig, resolved: ResolvedClasses, loaded: LoadedModel, backend: Backend, wanted: int, undo: Undo
) -> EstimationBuild:
    """The probe of ``wanted`` tokens, capped (``capped_probe_tokens``), and its executor. Its
    releases go on ``undo`` and on the artifact's ``release`` (profiling may run them early)."""
    tokens = capped_probe_tokens(config, resolved, backend, wanted)
    release = Undo()
    undo.push(release.run)
    with probe_oom("building the probe", max_num_tokens=config.max_num_tokens, probe_tokens=tokens):
        build = backend.build_estimation(loaded, resolved, tokens, config, release)
    return dataclasses.replace(build, release=release)


def capped_probe_tokens(config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend, wanted: int) -> int:
    """``wanted`` capped by the KV limits and by the free memory left beside the executor state;
    ``CapacityError`` when that room cannot hold one block of the final pools (no plan exists)."""
    return cap_probe_tokens(
        wanted,
        cost=resolved.probe_cost(tp=config.tensor_parallel_size, max_batch_size=config.max_batch_size),
        free_bytes=backend.device.free_bytes(),
        fraction=resolved.memory_rule.fraction,
        tokens_per_block=config.tokens_per_block,
        overhead_bytes=backend.estimation_overhead_bytes(resolved, config),
        max_kv_tokens=config.max_kv_tokens,
        max_kv_bytes=config.max_kv_bytes,
        plan_cost=resolved.total_cost,
        headroom_bytes=resolved.memory_rule.headroom_bytes,
    )


def cached_plan(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    backend: Backend,
    plan_cache: PlanCache | None,
) -> tuple[CachedPlan | None, str]:
    """The cached plan for this exact setup if the device has room for it now, and not much more
    than when it was measured; else None and why not: the cache is off, holds nothing for this
    setup, lacks the room, or has much more (with the figures)."""
    if plan_cache is None:
        return None, "off"
    cached = plan_cache.lookup(config, resolved, backend)
    if cached is None:
        return None, "no plan cached for this setup"
    free = backend.device.free_bytes()
    if not cached.fits(free, loaded.weight_bytes):
        needed = cached.needed_after_load(loaded.weight_bytes)
        return (
            None,
            f"no room: the cached plan needs {fmt_bytes(needed)} beside the weights, {fmt_bytes(free)} are free",
        )
    if cached.much_more_room(free, loaded.weight_bytes):
        measured = cached.measured_free() - loaded.weight_bytes
        return (
            None,
            f"more room: the cached plan was measured with {fmt_bytes(measured)} free beside the weights, "
            f"{fmt_bytes(free)} are free now",
        )
    return cached, ""


def skip_if_cached(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    backend: Backend,
    plan_cache: PlanCache | None,
) -> Skip | None:
    """Skip for a cached plan that fits; otherwise the stage span says why the probe is built."""
    cached, miss = cached_plan(config, resolved, loaded, backend, plan_cache)
    if cached is None:
        trace.get_current_span().set_attribute("bootstrap.plan_cache.miss", miss)
    return Skip(None, "plan-cache") if cached else None


STAGE = Stage(
    "estimation_build",
    estimation_build,
    provides="estimation",
    retry=on_oom(attempts=3),
    adapt=shrink_probe,
    skip=skip_if_cached,
    oom_advice=(
        "The probe does not fit even after the retries shrank it (each attempt's span records the change): "
        "start with max_num_tokens below the value above, lower max_batch_size or max_seq_len (the executor "
        "state beside the probe) or free_gpu_memory_fraction, or free device memory."
    ),
    figures=lambda e: {
        "bootstrap.kv.probe_tokens": e.probe_tokens,
        "bootstrap.kv.probe_bytes": e.probe_kv_bytes,
        "bootstrap.max_num_tokens": e.max_num_tokens,
    },
)
