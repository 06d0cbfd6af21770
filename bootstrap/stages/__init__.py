"""The stages of ``docs/design.md`` (the stage contract), one module each (the optional
``warmup`` included, between ``final_build`` and ``scheduler_sampler``); ``DEFAULT_STAGES`` is
the graph."""

from bootstrap.stages import (
    budget_split,
    capacity,
    estimation_build,
    final_build,
    load_model,
    profiling,
    resolve_classes,
    scheduler_sampler,
    warmup,
)

DEFAULT_STAGES = (
    resolve_classes.STAGE,
    load_model.STAGE,
    estimation_build.STAGE,
    profiling.STAGE,
    capacity.STAGE,
    budget_split.STAGE,
    final_build.STAGE,
    warmup.STAGE,
    scheduler_sampler.STAGE,
)
STAGE_IDS = tuple(s.id for s in DEFAULT_STAGES)
