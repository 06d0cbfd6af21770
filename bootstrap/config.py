"""The one validated configuration of a bootstrap run.

It is validated once, at the edge (CLI, server, Python caller), and is frozen afterwards: stages
never mutate it. A stage that must change a value (a retry lowering ``max_num_tokens``, say)
derives a new copy with ``model_copy(update=...)`` and records the change on its span.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KvDtype = Literal["auto", "float32", "bfloat16", "float16", "fp8"]
BackendName = Literal["native", "trtllm"]
KvManager = Literal["auto", "v1", "v2"]


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the allowed range."""


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is no ``bool``: ``isinstance(True, int)`` holds, yet ``True`` is no count,
    size or index wherever a value arrives unchecked (JSON, a caller, a request)."""
    return isinstance(value, int) and not isinstance(value, bool)


DEFAULT_SPECULATIVE_TOKENS = 4  # what vLLM and TensorRT-LLM users commonly run a draft with
MAX_SPECULATIVE_TOKENS = 16
AUTO_SPECULATIVE_CEILING = 8  # the deepest auto goes


class BootstrapConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    model: str = Field(
        "smollm2-135m-instruct",
        description="checkpoint dir, config.json, GGUF file, preset name, or random:<preset|config.json>",
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="auto, cpu, cuda or cuda:N")
    dtype: Dtype = "auto"
    kv_cache_dtype: KvDtype = "auto"
    max_batch_size: int = Field(32, ge=1, le=4096, description="requests in one forward step")
    max_num_tokens: int = Field(2048, ge=16, le=1_048_576, description="tokens in one forward step")
    max_seq_len: int | None = Field(None, ge=2, le=4_194_304, description="prompt + output tokens per request")
    tokens_per_block: int = Field(32, ge=1, le=1024, description="tokens per KV cache block")
    free_gpu_memory_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="TensorRT-LLM's rule: share of the memory left after the measured peak "
        "given to KV. None (neither this nor kv_headroom_bytes given): the backend's headroom where it has one "
        "(the native engine on CUDA), else 0.9; see bootstrap.capacity.rules",
    )
    kv_headroom_bytes: int | None = Field(
        None,
        ge=0,
        description="bytes kept free beyond the measured peak; when set, KV gets all the rest "
        "instead of free_gpu_memory_fraction of it (give one or the other)",
    )
    max_kv_bytes: int | None = Field(None, ge=1, description="explicit cap on the KV pool, in bytes")
    max_kv_tokens: int | None = Field(None, ge=1, description="explicit cap on KV capacity, in tokens")
    host_cache_bytes: int = Field(0, ge=0, description="host (CPU) KV tier size in bytes, 0 for none")
    draft_model: str | None = Field(None, description="two-model speculative decoding draft")
    num_speculative_tokens: int | Literal["auto"] | None = Field(
        None, description="tokens the draft proposes per step, or auto: per request from its acceptance (default 4)"
    )
    cross_kv_cache_fraction: float | None = Field(
        None, gt=0.0, lt=1.0, description="share of the KV budget for cross attention (encoder-decoder)"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    backend: BackendName = Field("native", description="whose executor the stages build and whose KV pricing plans use")
    kv_manager: KvManager = Field(
        "auto", description="TensorRT-LLM KV cache manager (backend trtllm only); auto picks what TensorRT-LLM picks"
    )
    plan_cache: Path | None = Field(None, description="directory of cached capacity plans; None disables it")
    cuda_graphs: bool = Field(True, description="capture decode steps as CUDA graphs in the warmup stage (CUDA only)")
    cuda_graph_batch_sizes: tuple[int, ...] | None = Field(
        None, description="batch sizes to capture; default 1, 2, 4, 8, then multiples of 8 up to max_batch_size"
    )
    prefix_caching: bool = Field(
        True, description="reuse the KV blocks of a prompt prefix computed before (TensorRT-LLM: enable_block_reuse)"
    )
    overlap: bool = Field(
        True,
        description="launch each step before the tokens of the one before are read (CUDA; a CPU step is done "
        "when launched, so there it is off). TensorRT-LLM: not disable_overlap_scheduler",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: the model's projections quantized to FP8 as a 16-bit checkpoint loads (one scale per "
        "output row); a checkpoint already FP8 loads as it is. None: the checkpoint's own weights",
    )

    @field_validator("free_gpu_memory_fraction", "cross_kv_cache_fraction", mode="before")
    @classmethod
    def _finite_fraction(cls, value: object, info: ValidationInfo) -> object:
        """NaN fails every bound silently ("should be <= 1" for nan): say what is allowed."""
        if isinstance(value, float) and not math.isfinite(value):
            upper = "1]" if info.field_name == "free_gpu_memory_fraction" else "1)"
            raise ValueError(f"must be a finite number in (0, {upper}")
        return value

    @field_validator("max_num_tokens")
    @classmethod
    def _room_for_the_batch(cls, value: int, info: ValidationInfo) -> int:
        batch = info.data.get("max_batch_size")
        if batch is not None and value < batch:
            raise ValueError(f"must be >= max_batch_size ({batch}): every request in a step needs a token")
        return value

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _within_the_batch(cls, value: tuple[int, ...] | None, info: ValidationInfo) -> tuple[int, ...] | None:
        if value is None:
            return None
        batch = info.data.get("max_batch_size")
        limit = batch if batch is not None else 4096
        if not value or any(b < 1 or b > limit for b in value):
            raise ValueError(f"must be batch sizes in [1, max_batch_size={limit}]")
        return tuple(sorted(set(value)))

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two in [1, 1024]")
        return value

    @property
    def speculative_tokens(self) -> int:
        """Draft tokens per step (with ``auto``: the most a request may propose): 4 with a draft
        by default, 0 without one."""
        if self.draft_model is None:
            return 0
        if self.num_speculative_tokens == "auto":
            return AUTO_SPECULATIVE_CEILING
        return self.num_speculative_tokens if self.num_speculative_tokens is not None else DEFAULT_SPECULATIVE_TOKENS

    @field_validator("num_speculative_tokens", mode="before")
    @classmethod
    def _depth(cls, value: object) -> object:
        ok = value is None or value == "auto" or (is_int(value) and 1 <= value <= MAX_SPECULATIVE_TOKENS)
        if not ok:
            raise ValueError(f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] or 'auto'")
        return value

    @model_validator(mode="after")
    def _speculation_needs_a_draft(self) -> BootstrapConfig:
        if self.num_speculative_tokens is not None and self.draft_model is None:
            raise ValueError("num_speculative_tokens needs a draft_model (the model that proposes the tokens)")
        return self

    @model_validator(mode="after")
    def _one_memory_rule(self) -> BootstrapConfig:
        if self.kv_headroom_bytes is not None and self.free_gpu_memory_fraction is not None:
            raise ValueError(
                "kv_headroom_bytes and free_gpu_memory_fraction are two ways to share the memory left after the "
                "measured peak; give one of them"
            )
        return self

    @classmethod
    def parse(cls, **values: object) -> BootstrapConfig:
        """Validate ``values``; raise ``ConfigError`` naming every bad field, on one line."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """Every bad field with its allowed range and the value given, on one line (``; ``
    between fields): the CLI's contract is one line on stderr."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{field}: {message} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(parts)
