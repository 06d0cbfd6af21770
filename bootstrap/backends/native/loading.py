"""The native backend's ``load_model``: a checkpoint's weights allocated and read in the
background (``engine.models.reading``), the stages that need their values waiting for them, and
the tokenizer loaded once per directory, by ``resolve_classes`` (a swap's check)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace

from bootstrap.backends.artifacts import LoadedModel, ResolvedClasses
from bootstrap.backends.native.builds import NativeModels
from bootstrap.backends.native.checks import unreadable_as_source_error
from bootstrap.config import BootstrapConfig
from bootstrap.engine.sources.checkpoint import checkpoint_tokenizer
from bootstrap.engine.sources.loader import CHECKPOINT, LoadedWeights, load_model, resolve_source
from bootstrap.engine.sources.progress_lines import Progress
from bootstrap.pipeline.undo import Undo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}  # a KV pool's: e4m3 with per-layer scales


class Loading:
    """``load_model`` for ``NativeBackend`` (its mixin)."""

    torch_device: torch.device
    cache_dir: Path | None
    tp: int
    progress: Progress
    _tokenizers: dict[Path, Any]  # by directory: loaded by resolve_classes, taken by load_model
    _settler: Callable[[], Callable[[], None]]

    def load_model(self, config: BootstrapConfig, resolved: ResolvedClasses, undo: Undo) -> LoadedModel:
        target = self._load(config.model, resolved.dtype, undo, config.quantization)
        draft = self._load(config.draft_model, resolved.dtype, undo) if config.draft_model else None
        total = target.weight_bytes + (draft.weight_bytes if draft else 0)
        models = NativeModels(target, draft, config.tokens_per_block, resolved.max_seq_len)
        return LoadedModel(models, total, draft_handle=draft, tokenizer=target.tokenizer)

    def _load(self, source: str, dtype: str, undo: Undo, quantize: str | None = None) -> LoadedWeights:
        undo.push(self._settler())  # a load that fails half way leaves garbage for the allocator's cache
        with unreadable_as_source_error(source):
            weights = load_model(
                source,
                device=self.torch_device,
                dtype=DTYPES[dtype],
                cache_dir=self.cache_dir,
                tp_size=self.tp,
                progress=self.progress,
                background=True,  # read while final_build and warmup run: a capture needs addresses only
                tokenizer_of=self._tokenizer_of,
                quantize=quantize,
            )
        undo.push(lambda: weights.model.to(torch.device("meta")))  # frees the storage even if a reference survives
        undo.push(weights.stop_reading)  # first: no read may write into storage released under it
        return weights

    def _await_weights(self, loaded: LoadedModel) -> float:
        """Every weight read (``_load`` reads in the background); the seconds waited, and on the
        waiting attempt's span the read's own seconds and bytes (``load_model``'s span ends
        before the read does)."""
        waited, span = 0.0, trace.get_current_span()
        for name, weights in loaded.handle.by_name().items():
            waited += weights.wait_for_weights()
            if weights.reading is not None and weights.reading.seconds is not None:
                span.set_attribute(f"bootstrap.weights.{name}.read_s", round(weights.reading.seconds, 6))
                span.set_attribute(f"bootstrap.weights.{name}.read_bytes", weights.reading.nbytes)
                if weights.reading.compile_wait_s is not None:  # of read_s, the kernels' compile after the bytes
                    span.set_attribute(
                        f"bootstrap.weights.{name}.compile_wait_s", round(weights.reading.compile_wait_s, 6)
                    )
        span.set_attribute("bootstrap.weights.waited_s", round(waited, 6))
        return waited

    def _preload_tokenizer(self, source: str) -> None:
        """A checkpoint directory's tokenizer, loaded (and a broken one refused) here: a swap's
        check runs while the old model serves, and ``load_model`` then takes it as it is."""
        resolved = resolve_source(source)
        if resolved.kind == CHECKPOINT:
            with unreadable_as_source_error(source):
                self._tokenizer_of(resolved.path)

    def _tokenizer_of(self, path: Path) -> Any:
        key = path.resolve()
        if key not in self._tokenizers:
            self._tokenizers[key] = checkpoint_tokenizer(path)
        return self._tokenizers[key]
