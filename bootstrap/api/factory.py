"""What a build runs on: the pipeline of the stages over a backend, and the backend a config names."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from importlib.util import find_spec

from opentelemetry.trace import TracerProvider

from bootstrap.backends.base import Backend, HasCollective
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline import Pipeline, Stage
from bootstrap.pipeline.events import EventHub
from bootstrap.pipeline.telemetry import MissingExtra
from bootstrap.stages import DEFAULT_STAGES
from bootstrap.stages.plan_cache import PlanCache


def make_pipeline(
    config: BootstrapConfig,
    backend: Backend,
    *,
    tracer_provider: TracerProvider | None = None,
    stages: Sequence[Stage] = DEFAULT_STAGES,
    relay: EventHub | None = None,
    releasable_bytes: int = 0,
) -> Pipeline:
    """On several ranks (a backend with a ``collective``), every attempt is agreed across them
    and the plan cache is off: one rank's cache hit must not skip a stage its peers run. The plan
    cache made here stores the plan once ``capacity`` has succeeded; that stage only computes it.
    ``relay``: a ``Bootstrap``'s hub, which sees every pipeline's events; ``releasable_bytes``: what
    a swap's old model gives back before this one loads (``resolve_classes``)."""
    collective = backend.collective if isinstance(backend, HasCollective) else None
    several = collective is not None and collective.world_size > 1
    plan_cache = PlanCache(config.plan_cache) if config.plan_cache and not several else None
    inputs = {"config": config, "backend": backend, "plan_cache": plan_cache, "releasable_bytes": releasable_bytes}
    has_capacity = any(stage.id == "capacity" for stage in stages)
    after = {"capacity": plan_cache.remember_measured} if plan_cache is not None and has_capacity else {}
    return Pipeline(
        stages,
        inputs,
        tracer_provider=tracer_provider,
        device=backend.device,
        collective=collective,
        after=after,
        relay=relay,
    )


def require_engine() -> None:
    """``MissingExtra`` naming the install command when torch is missing (the planner needs none;
    every real backend does)."""
    if find_spec("torch") is None:
        raise MissingExtra(
            "this command runs a real engine, which needs torch: "
            "pip install torch==2.13.0 && pip install -e '.[engine]' (a CUDA build of torch on a GPU)"
        )


def default_backend(config: BootstrapConfig) -> Backend:
    """The backend ``config.backend`` names on ``config.device``; without torch, or ``trtllm``
    without TensorRT-LLM installed, ``MissingExtra`` naming the install command."""
    require_engine()
    from bootstrap.backends.native.backend import NativeBackend  # imports torch: only when asked for
    from bootstrap.backends.native.placement import device_for

    if config.backend == "trtllm":
        from bootstrap.backends.trtllm import create_backend

        return create_backend(device_for(config.device)[0])
    return NativeBackend.for_config(config)


def factory_parts(spec: str) -> tuple[str, str]:
    """``module:callable`` split in two; ``ConfigError`` for any other shape (checked before the
    port opens, so a typo is exit 2 at once, not a failed bootstrap)."""
    module_name, _, attr = spec.partition(":")
    if not module_name.strip() or not attr.strip():
        raise ConfigError(f"backend_factory: expected 'module:callable', got {spec!r}")
    return module_name, attr


def load_backend_factory(spec: str | None) -> Callable[[BootstrapConfig], Backend]:
    """None: the backend ``config.backend`` names (native or trtllm); else ``module:callable``,
    a callable ``(config) -> Backend`` (a custom backend, e.g. one wrapping the native engine)."""
    if spec is None:
        return default_backend
    module_name, attr = factory_parts(spec)
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise ConfigError(f"backend_factory: {module_name} has no callable {attr!r} (got {spec!r})")
    return factory
