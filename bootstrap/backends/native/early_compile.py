"""The target's kernels compiled from its config.json as the backend is made, before any stage.

Triton's first compile of the engine's kernels takes seconds on an empty cache, and the load's
compile-ahead (``engine.models.compile_ahead``) begins only with ``load_model``. On one CUDA
device, ``NativeBackend.for_config`` begins it here instead, on the shapes the load will build: a
checkpoint's config.json (or a ``random:`` preset's), the dtype ``resolve_classes`` will pick, the
quantization asked. A source of another kind, or shapes the own code does not run, begin nothing.
"""

from __future__ import annotations

import functools

import torch

from bootstrap.backends.native.loading import DTYPES
from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.shape import ModelConfigError
from bootstrap.config import BootstrapConfig
from bootstrap.engine.models import build_own_model, own_model_problem
from bootstrap.engine.models.compile_ahead import begin_early
from bootstrap.engine.models.files import ModelSourceError, read_json
from bootstrap.engine.sources import random_init
from bootstrap.engine.sources.loader import CHECKPOINT, RANDOM, resolve_source


def begin_for(config: BootstrapConfig, torch_device: torch.device) -> bool:
    """``compile_ahead.begin_early`` for ``config``'s target on ``torch_device``; True when begun."""
    if torch_device.type != "cuda" or config.backend != "native" or config.tensor_parallel_size != 1:
        return False
    try:
        source = resolve_source(config.model)
        if source.kind == CHECKPOINT:
            cfg = read_json(source.path / "config.json")
        elif source.kind == RANDOM:
            cfg = random_init.config_dict(source.random_spec)
        else:
            return False
        dtype = config.dtype if config.dtype != "auto" else cuda_default_dtype(parse_config(cfg).torch_dtype)
    except (ModelSourceError, ModelConfigError, OSError, ValueError):
        return False  # resolve_classes says what is wrong with it
    if own_model_problem(cfg) is not None:
        return False
    meta = functools.partial(build_own_model, cfg, torch.device("meta"), DTYPES[dtype], quantize=config.quantization)
    return begin_early(meta, torch_device, DTYPES[dtype])


def cuda_default_dtype(checkpoint_dtype: str | None) -> str:
    """A model's dtype on CUDA when none is asked: the checkpoint's 16-bit dtype, else bfloat16."""
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
