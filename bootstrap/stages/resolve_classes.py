"""Stage 1, ``resolve_classes``: validate the config against the model's config.json and pick
the KV layout, its per-token cost, and the classes; config errors fail here, before any load."""

from __future__ import annotations

import dataclasses

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.backends.base import Backend, ChecksWeights
from bootstrap.capacity import CacheCost, kv_dtype_bytes
from bootstrap.capacity.pricing import TRTLLM_KV_MANAGERS, kv_cost, resolve_kv_manager
from bootstrap.capacity.quantization import AT_LOAD
from bootstrap.capacity.rules import MemoryRule
from bootstrap.capacity.shape import ModelShape, check_tp_split
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline.stage import Stage


def resolve_classes(config: BootstrapConfig, backend: Backend, releasable_bytes: int = 0) -> ResolvedClasses:
    """``releasable_bytes``: device memory the model serving now gives back before this one
    loads (a live swap; 0 at a start), counted as free by the weights' check."""
    shape = quantized_at_load(backend.model_shape(config.model), config)
    draft = backend.model_shape(config.draft_model) if config.draft_model else None
    check_config(config, shape, draft)
    models = [m for m in (shape, draft) if m is not None]
    for model in models:
        backend.check_config(config, model)
    dtype = config.dtype if config.dtype != "auto" else backend.default_dtype(shape)
    if isinstance(backend, ChecksWeights):
        backend.check_weights(config, models, dtype, releasable_bytes)  # before any weight is allocated
    manager = resolve_kv_manager(config, shape)
    max_seq_len = config.max_seq_len or shape.max_position_embeddings
    kv_dtype = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else dtype
    resolved = ResolvedClasses(
        shape=shape,
        draft_shape=draft,
        kv_layout=kv_layout(shape),
        cost=_cost(shape, config, kv_dtype, max_seq_len, manager),
        draft_cost=_cost(draft, config, kv_dtype, max_seq_len, manager) if draft else None,
        cross_cost=None,
        max_seq_len=max_seq_len,
        dtype=dtype,
        kv_dtype=kv_dtype,
        kv_manager=TRTLLM_KV_MANAGERS[manager] if manager else backend.kv_manager,
        memory_rule=MemoryRule.resolve(config.free_gpu_memory_fraction, config.kv_headroom_bytes, None),
    )
    return resolve_memory_rule(config, backend, resolved)


def resolve_memory_rule(config: BootstrapConfig, backend: Backend, resolved: ResolvedClasses) -> ResolvedClasses:
    """``resolved`` with the run's memory rule (``bootstrap.capacity.rules``): the config's, or,
    when it gives none, the backend's headroom as known before profiling."""
    if resolved.memory_rule.source != "default_fraction":
        return resolved
    headroom = backend.default_headroom_bytes(None, resolved, config)
    return dataclasses.replace(resolved, memory_rule=MemoryRule.resolve(None, None, headroom))


def quantized_at_load(shape: ModelShape, config: BootstrapConfig) -> ModelShape:
    """The target's shape as it will load: with ``quantization: fp8``, a 16-bit checkpoint's
    projections in FP8 (``capacity.quantization.AT_LOAD``); an FP8 one as it is."""
    if config.quantization is None or (shape.quantization is not None and shape.quantization.fp8):
        return shape
    if shape.quantization is not None:
        raise ConfigError(
            f"quantization: fp8 for a checkpoint quantized with {shape.quantization.method!r}; allowed: "
            "fp8 for a 16-bit or FP8 checkpoint, or leave it unset"
        )
    return dataclasses.replace(shape, quantization=AT_LOAD)


def kv_layout(shape: ModelShape) -> str:
    """e.g. "gqa", "mla", "gqa+swa" (some sliding-window layers), "gqa+recurrent" (hybrid)."""
    layout = shape.attention_kind
    if any(w is not None for w in shape.attention_windows):
        layout += "+swa"
    if shape.num_recurrent_layers:
        layout += "+recurrent"
    return layout


def _cost(
    shape: ModelShape, config: BootstrapConfig, kv_dtype: str, max_seq_len: int, manager: str | None
) -> CacheCost:
    """Priced as the KV manager that will hold it counts (``bootstrap.capacity.pricing``)."""
    return kv_cost(shape, config, kv_dtype_bytes=kv_dtype_bytes(kv_dtype), max_seq_len=max_seq_len, kv_manager=manager)


def check_config(config: BootstrapConfig, shape: ModelShape, draft: ModelShape | None) -> None:
    """The config against the model's (and draft's) config.json; the CLI runs it before torch too."""
    limit = shape.max_position_embeddings
    if limit < 2:
        raise ConfigError(f"model: max_position_embeddings is {limit}; a served model needs at least 2 positions")
    if config.max_seq_len is not None and config.max_seq_len > limit:
        raise ConfigError(
            f"max_seq_len: {config.max_seq_len} exceeds the model's max_position_embeddings; allowed 2..{limit}"
        )
    if config.cross_kv_cache_fraction is not None:
        raise ConfigError(
            f"cross_kv_cache_fraction: set to {config.cross_kv_cache_fraction}, but {shape.model_type} is a "
            "decoder-only model with no cross-attention cache; leave it unset"
        )
    if draft is not None and draft.vocab_size != shape.vocab_size:
        raise ConfigError(
            f"draft_model: {config.draft_model!r} has a vocabulary of {draft.vocab_size} tokens and the target "
            f"{config.model!r} one of {shape.vocab_size}; a draft model must share the target's tokenizer"
        )
    if draft is not None:
        _check_draft(config, shape, draft)
    tp = config.tensor_parallel_size
    for field, model in (("model", shape), ("draft_model", draft)):
        if model is not None:
            check_tp_split(model, tp, field)


def _check_draft(config: BootstrapConfig, shape: ModelShape, draft: ModelShape) -> None:
    """A draft must reach every position the target serves (else it fails late, at estimation_build,
    not named) and be smaller than the target (a larger one only slows decoding)."""
    max_seq_len = config.max_seq_len or shape.max_position_embeddings
    if draft.max_position_embeddings < max_seq_len:
        raise ConfigError(
            f"draft_model: {config.draft_model!r} has max_position_embeddings {draft.max_position_embeddings}, below "
            f"max_seq_len {max_seq_len}; allowed max_seq_len 2..{draft.max_position_embeddings} with this draft, "
            "or a draft that covers the target's positions"
        )
    if draft.parameter_count() > shape.parameter_count():
        raise ConfigError(
            f"draft_model: {config.draft_model!r} has {draft.parameter_count():,} parameters, more than the target "
            f"{config.model!r}'s {shape.parameter_count():,}; a draft model must be at most the target's size"
        )


# Blocking: a real backend reads config files (the default model may be fetched once) and
# imports transformers; none of that may stall the event loop that answers health probes.
def _stage(config: BootstrapConfig, backend: Backend, releasable_bytes: int) -> ResolvedClasses:
    return resolve_classes(config, backend, releasable_bytes)  # the pipeline input, never defaulted


STAGE = Stage("resolve_classes", _stage, provides="resolved")
