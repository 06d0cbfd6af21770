"""``resolve_classes`` for ``NativeBackend`` (its mixin): the shape as the native pool stores it,
the default dtype, and what the engine cannot run, refused before any weight is loaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.backends.native.checks import (
    check_draft_tokenizer,
    check_fp8_kv,
    check_probe_tokens,
    check_quantization,
    check_weights_fit,
    unreadable_as_source_error,
)
from bootstrap.backends.native.early_compile import cuda_default_dtype
from bootstrap.backends.native.loading import DTYPES
from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.quantization import AT_LOAD
from bootstrap.capacity.shape import ModelShape, check_tp_split
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import Device
from bootstrap.engine.models import own_model_problem
from bootstrap.engine.sources.loader import check_quantizable, check_source, config_dict, resolve_source
from bootstrap.engine.sources.progress_lines import Progress


class Resolving:
    """``model_shape``, ``default_dtype``, ``check_config``, ``check_weights`` and
    ``check_checkpoints`` for ``NativeBackend``."""

    device: Device
    torch_device: torch.device
    cache_dir: Path | None
    tp: int
    progress: Progress

    _preload_tokenizer: Callable[[str], None]  # ``Loading``'s

    def model_shape(self, spec: str) -> ModelShape:
        """The shape as the native pool stores it: every attention layer at full length."""
        with unreadable_as_source_error(spec):
            shape = parse_config(config_dict(spec, cache_dir=self.cache_dir, progress=self.progress))
        return dataclasses.replace(shape, layer_windows=(None,) * shape.num_layers)

    def _check_quantizable(self, source: str) -> None:
        """``quantization: fp8`` quantizes a checkpoint on the engine's own code as it is read."""
        check_quantizable(resolve_source(source), "fp8")
        with unreadable_as_source_error(source):
            problem = own_model_problem(config_dict(source, cache_dir=self.cache_dir, progress=self.progress))
        if problem is not None:
            raise ConfigError(f"quantization: fp8 needs a model on the engine's own code; {source!r} has {problem}")

    def default_dtype(self, shape: ModelShape) -> str:
        """float32 on the CPU (exact parity with transformers); the checkpoint's 16-bit dtype,
        else bfloat16, on CUDA."""
        if self.torch_device.type == "cpu":
            return "float32"
        return cuda_default_dtype(shape.torch_dtype)

    def check_config(self, config: BootstrapConfig, shape: ModelShape) -> None:
        """What the native engine cannot run, refused before any weight is loaded."""
        check_fp8_kv(config.kv_cache_dtype, self.torch_device)
        if config.tensor_parallel_size != self.tp:
            raise ConfigError(
                f"tensor_parallel_size: {config.tensor_parallel_size}, but this backend runs on {self.tp} rank(s); "
                f"launch {config.tensor_parallel_size} ranks (bootstrap run --tp N, or torchrun) or use {self.tp}"
            )
        check_tp_split(shape, self.tp, shard_kv_heads=True)
        check_draft_tokenizer(config)
        if config.host_cache_bytes:
            raise ConfigError("host_cache_bytes: the native engine has no host KV tier; allowed: 0")
        check_quantization(shape, self.torch_device, self.tp)
        if shape.quantization is AT_LOAD:  # the target, to be quantized as it loads
            self._check_quantizable(config.model)
        if shape.attention_kind == "mla" or shape.num_recurrent_layers:
            kind = "multi-head latent attention" if shape.attention_kind == "mla" else "recurrent layers"
            raise ConfigError(f"model: {shape.architecture} uses {kind}, which the native paged KV cache does not hold")
        check_probe_tokens(config, shape)
        self._preload_tokenizer(config.model)

    def check_weights(
        self, config: BootstrapConfig, shapes: list[ModelShape], dtype: str, releasable_bytes: int = 0
    ) -> None:
        """The weights of ``shapes`` in ``dtype`` against the device's free bytes (and what the
        serving model releases first), before ``load_model`` allocates any (``checks``)."""
        check_weights_fit(config, shapes, dtype, self.device, self.tp, releasable_bytes)

    def check_checkpoints(self, config: BootstrapConfig, resolved: ResolvedClasses) -> None:
        """What ``load_model`` would refuse from the target's and the draft's headers and
        config.json (``loader.check_source``), reading no weight: a swap's check before its drain."""
        dtype = DTYPES[resolved.dtype]
        for source, quantize in ((config.model, config.quantization), (config.draft_model, None)):
            if source is not None:
                with unreadable_as_source_error(source):
                    check_source(source, dtype=dtype, cache_dir=self.cache_dir, tp_size=self.tp, quantize=quantize)
