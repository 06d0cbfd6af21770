"""What the native backend refuses in ``resolve_classes`` from figures alone, before any weight
is loaded: a ``max_kv_tokens`` below what profiling's dummy needs, and weights the device cannot
hold (on the CPU those end in the kernel's OOM killer, not an error)."""

from __future__ import annotations

from bootstrap.backends.activations import weight_dtype_bytes
from bootstrap.capacity import dummy_request_lengths
from bootstrap.capacity.errors import fmt_bytes
from bootstrap.capacity.shape import ModelShape
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import Device


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


def check_weights_fit(config: BootstrapConfig, shapes: list[ModelShape], dtype: str, device: Device, tp: int) -> None:
    """The weights' bytes (the target's and a draft's, in ``dtype``), known from the shapes,
    against ``device``'s free bytes. Each rank holds 1/tp of the parameters. Tolerance: none
    beyond counting low: the count leaves out buffers, parts replicated on every rank and the
    allocator's rounding, so a refusal is never wrong; what else must fit (KV, activations) is
    the later stages' to plan."""
    need = sum(-(-shape.weight_bytes(weight_dtype_bytes(dtype)) // tp) for shape in shapes)
    free = device.free_bytes()
    if need > free:
        raise ConfigError(weights_refusal(config, dtype, need, free, device.name, tp))


def weights_refusal(config: BootstrapConfig, dtype: str, need: int, free: int, device: str, tp: int) -> str:
    """The figures of weights that cannot fit, and what to change."""
    models = f"{config.model} + draft {config.draft_model}" if config.draft_model else config.model
    per_rank = f" per rank (1/{tp} of the parameters)" if tp > 1 else ""
    smaller = " (e.g. --dtype bfloat16)" if dtype == "float32" else ""
    return (f"model: the weights of {models} in {dtype} need {fmt_bytes(need)}{per_rank}, but {device} has "
            f"{fmt_bytes(free)} available; use a smaller dtype{smaller}, another device (--device), more "
            "tensor_parallel_size, or a smaller model")  # fmt: skip
