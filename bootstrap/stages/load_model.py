"""Stage 2, ``load_model``: weights (and draft weights) onto the device, and the tokenizer.
Retries transient I/O errors; an OOM here is final (the weights do not fit at all)."""

from __future__ import annotations

from bootstrap.backends.artifacts import LoadedModel, ResolvedClasses
from bootstrap.backends.base import Backend
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import RetryPolicy, Stage, is_transient_io
from bootstrap.pipeline.undo import Undo


def load_model(config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend, undo: Undo) -> LoadedModel:
    return backend.load_model(config, resolved, undo)


STAGE = Stage(
    "load_model",
    load_model,
    provides="loaded",
    retry=RetryPolicy(attempts=3, retry_on=is_transient_io, backoff_s=0.5),
    figures=lambda m: {"bootstrap.model.weight_bytes": m.weight_bytes},
    oom_advice="The weights alone do not fit: raise tensor_parallel_size, use a smaller dtype, or a larger device.",
)
