"""What the native backend refuses in ``resolve_classes`` from figures alone, before any weight
is loaded: a ``max_kv_tokens`` below what profiling's dummy needs, weights the device cannot
hold (on the CPU those end in the kernel's OOM killer, not an error), and a draft model whose
tokenizer is not the target's; and, while weights load, a file that is not a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bootstrap.backends.activations import weight_dtype_bytes
from bootstrap.capacity import dummy_request_lengths
from bootstrap.capacity.errors import fmt_bytes
from bootstrap.capacity.shape import ModelConfigError, ModelShape
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import Device, is_oom
from bootstrap.engine.sources.loader import ModelSourceError
from bootstrap.engine.sources.smollm2 import ModelFetchError
from bootstrap.pipeline.stage import is_transient_io

if TYPE_CHECKING:
    import torch

FP8_CAPABILITY = (8, 9)  # e4m3 arithmetic: Ada and Hopper onwards


def check_probe_tokens(config: BootstrapConfig, shape: ModelShape) -> None:
    """``max_kv_tokens`` caps the probe; below the largest profiling dummy it fails profiling
    (exit 1) though it is a bad value: refused here, once ``max_seq_len`` is known."""
    if config.max_kv_tokens is None:
        return
    max_seq_len = config.max_seq_len or shape.max_position_embeddings
    dummy = max(dummy_request_lengths(config.max_num_tokens, max_seq_len))
    need = -(-dummy // config.tokens_per_block) * config.tokens_per_block
    if config.max_kv_tokens < need:
        raise ConfigError(
            f"max_kv_tokens: must be >= {need} (got {config.max_kv_tokens}): profiling runs a dummy request of "
            f"{dummy} tokens (max_num_tokens={config.max_num_tokens}, max_seq_len={max_seq_len}); raise "
            "max_kv_tokens, or lower max_num_tokens or max_seq_len"
        )


def check_weights_fit(
    config: BootstrapConfig, shapes: list[ModelShape], dtype: str, device: Device, tp: int, releasable_bytes: int = 0
) -> None:
    """The weights' bytes (the target's and a draft's, in ``dtype``), known from the shapes,
    against ``device``'s free bytes. Each rank holds 1/tp of the parameters. Tolerance: none
    beyond counting low: the count leaves out buffers, parts replicated on every rank and the
    allocator's rounding, so a refusal is never wrong; what else must fit (KV, activations) is
    the later stages' to plan."""
    need = sum(-(-shape.weight_bytes(weight_dtype_bytes(dtype)) // tp) for shape in shapes)
    free = device.free_bytes() + releasable_bytes
    if need > free:
        raise ConfigError(weights_refusal(config, dtype, need, free, device.name, tp))


def weights_refusal(config: BootstrapConfig, dtype: str, need: int, free: int, device: str, tp: int) -> str:
    """The figures of weights that cannot fit, and what to change."""
    models = f"{config.model} + draft {config.draft_model}" if config.draft_model else config.model
    per_rank = f" per rank (1/{tp} of the parameters)" if tp > 1 else ""
    smaller = " (e.g. --dtype bfloat16)" if dtype == "float32" else ""
    return (
        f"model: the weights of {models} in {dtype} need {fmt_bytes(need)}{per_rank}, but {device} has "
        f"{fmt_bytes(free)} available; use a smaller dtype{smaller}, another device (--device), more "
        "tensor_parallel_size, or a smaller model"
    )


def check_draft_tokenizer(config: BootstrapConfig) -> None:
    """A draft whose tokenizer maps tokens to other ids than the target's (same vocabulary size,
    other tokens) would propose ids that mean something else to the target: refused, naming
    both, when both are checkpoint directories with a ``tokenizer.json`` (read, nothing loaded).
    Sizes are compared for every source by ``resolve_classes`` itself."""
    if config.draft_model is None:
        return
    vocabs = [_vocab(source) for source in (config.model, config.draft_model)]
    if None in vocabs or vocabs[0] == vocabs[1]:
        return
    target, draft = vocabs
    differ = sum(draft.get(token) != index for token, index in target.items()) + len(draft.keys() - target.keys())
    raise ConfigError(
        f"draft_model: {config.draft_model!r}'s tokenizer ({len(draft)} tokens) is not the target {config.model!r}'s "
        f"({len(target)} tokens): {differ} tokens have other ids or are missing; a draft model must share the "
        "target's tokenizer"
    )


def _vocab(source: str) -> dict[str, int] | None:
    """Token → id of a checkpoint directory's ``tokenizer.json`` (its added tokens included); None
    for any other source, or a file that does not read as one."""
    path = Path(source) / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
        vocab = {piece[0]: index for index, piece in enumerate(vocab) if isinstance(piece, list) and piece}
    if not isinstance(vocab, dict):
        return None
    added = {t.get("content"): t.get("id") for t in data.get("added_tokens", []) if isinstance(t, dict)}
    return {**vocab, **added}


@contextmanager
def unreadable_as_source_error(source: str) -> Iterator[None]:
    """A file that is there but is not a model (corrupt weights, a GGUF that is not GGUF) is bad
    input, reported in one line; out-of-memory, transient I/O and fetch errors pass unchanged
    (the stage retries the first two; the last already says how to work offline)."""
    try:
        yield
    except (ModelSourceError, ModelConfigError, ModelFetchError):
        raise
    except Exception as exc:
        if is_oom(exc) or is_transient_io(exc):
            raise
        raise ModelSourceError(f"model {source!r} cannot be read: {type(exc).__name__}: {exc}") from exc


def check_weights_dir(path: str, live_config: Any) -> Path:
    """``path`` as new weights for a model of ``live_config`` (its transformers config): a
    checkpoint directory whose ``config.json`` names the same ``model_type`` and sizes; else
    ``ConfigError`` naming the field."""
    directory = Path(path)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        raise ConfigError(f"path: {path!r} is not a checkpoint directory (one with config.json and safetensors)")
    try:
        new = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"path: {directory / 'config.json'} cannot be read: {exc}") from None
    if not isinstance(new, dict):
        raise ConfigError(f"path: {directory / 'config.json'} is not a JSON object")
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        have, given = getattr(live_config, key, None), new.get(key)
        if have is not None and given != have:
            raise ConfigError(
                f"path: {key} is {given!r} in {directory / 'config.json'}, the serving model's is {have!r}; "
                "new weights must be of the same model (swap to serve another)"
            )
    return directory


def check_quantization(shape: ModelShape, device: torch.device, tp: int = 1) -> None:
    """FP8 weights the engine reads (``layers.fp8``): dynamic activations, on the CPU or a GPU
    with FP8 (compute capability 8.9 or newer), block scales whole on every rank; nothing else
    quantized."""
    q = shape.quantization
    if q is None:
        return
    if not q.fp8:
        raise ConfigError(
            f"quantization_config: quant_method {q.method!r} is not loaded by the native engine; allowed: "
            "compressed-tensors (float-quantized FP8), fp8"
        )
    if not q.dynamic_activations:
        raise ConfigError(
            "quantization_config: static activation scales are not used by the native engine; allowed: dynamic "
            "(activation_scheme dynamic, or input_activations dynamic: true)"
        )
    if (capability := _short_of_fp8(device)) is not None:
        raise ConfigError(
            f"quantization_config: FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"{device} is {capability}: use a 16-bit checkpoint"
        )
    if q.block is not None:
        _check_blocks(shape, q.block, tp)


def check_fp8_kv(kv_cache_dtype: str, device: torch.device) -> None:
    """An e4m3 KV pool: on the CPU, or a GPU with FP8 (8.9 or newer: the kernels convert in hardware)."""
    if kv_cache_dtype == "fp8" and (capability := _short_of_fp8(device)) is not None:
        raise ConfigError(
            f"kv_cache_dtype: fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {device} is "
            f"{capability}; allowed here: auto, float32, bfloat16, float16"
        )


def _short_of_fp8(device: torch.device) -> str | None:
    """A CUDA device's compute capability ("8.0") when it is below ``FP8_CAPABILITY``; else None."""
    import torch

    if device.type != "cuda" or (capability := torch.cuda.get_device_capability(device)) >= FP8_CAPABILITY:
        return None
    return "{}.{}".format(*capability)


def _check_blocks(shape: ModelShape, block: tuple[int, int], tp: int) -> None:
    """Every rank's rows of each fused part, and under tensor parallelism its input columns of
    the row-parallel projections, whole blocks of ``weight_block_size``."""
    q, kv, mlp = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    shares = [("q_proj rows", q, block[0]), ("k_proj and v_proj rows", kv, block[0]), ("MLP rows", mlp, block[0])]
    if tp > 1:
        shares += [("o_proj columns", q, block[1]), ("down_proj columns", mlp, block[1])]
    for what, n, size in shares:
        if n % tp or (n // tp) % size:
            raise ConfigError(
                f"quantization_config.weight_block_size: {list(block)} does not divide the {what} "
                f"({n} over {tp} rank(s)); allowed: blocks that divide each rank's share"
            )
