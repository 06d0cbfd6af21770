"""FP8 weights as a ``config.json`` declares them, priced by the plan: 1 byte a weight for the
matrices the checkpoint stores in FP8, plus their scales.

Two layouts: compressed-tensors ``float-quantized`` (one config group of 8-bit float weights,
``strategy`` ``channel`` or ``tensor``; the FP8 releases of Llama 3.1 and many others) and
``quant_method: "fp8"`` with ``weight_block_size`` (``weight_scale_inv`` per block: Qwen3 and
DeepSeek's releases). The matrices priced at 1 byte are the attention and MLP (expert)
projections, unless ``ignore`` names them; everything else (embeddings, norms, routers, recurrent
projections, ``lm_head``) stays at the checkpoint's 16 bits, so a layout that keeps more in 16 bits
is over-, never under-priced. Scales are priced at 4 bytes each. Any other ``quant_method`` is
kept as its name (``WeightQuantization.method``) and priced at 16 bits. ``AT_LOAD`` is the
layout ``quantization: fp8`` gives a 16-bit checkpoint as it loads: one scale per output row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

SCALE_BYTES = 4


class QuantizationError(ValueError):
    """A ``quantization_config`` that cannot be priced (``config_json`` says it as a ``ModelConfigError``)."""


@dataclass(frozen=True)
class WeightQuantization:
    method: str  # quant_method as the config says it
    strategy: str | None = None  # channel, tensor or block: None where the method is not FP8
    block: tuple[int, int] | None = None  # weight_block_size (output rows, input columns)
    ignore: tuple[str, ...] = ()  # module names, or "re:" patterns, left in 16 bits
    dynamic_activations: bool = True  # activations quantized per token at run time

    @property
    def fp8(self) -> bool:
        return self.strategy is not None

    def ignores(self, module: str) -> bool:
        return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module for entry in self.ignore)

    def scale_bytes(self, rows: int, columns: int) -> int:
        """The scales of one ``rows x columns`` matrix."""
        if self.strategy == "tensor":
            return SCALE_BYTES
        if self.strategy == "channel":
            return rows * SCALE_BYTES
        return math.ceil(rows / self.block[0]) * math.ceil(columns / self.block[1]) * SCALE_BYTES


AT_LOAD = WeightQuantization("fp8-at-load", "channel")


def parse_quantization(cfg: dict[str, Any]) -> WeightQuantization | None:
    """The weights' quantization of a parsed config.json, or None for 16-bit weights."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
        raise QuantizationError("quantization_config: must be an object with a string quant_method")
    method = q["quant_method"]
    if method == "fp8":
        return _block_fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    return WeightQuantization(method)


def _block_fp8(q: dict[str, Any]) -> WeightQuantization:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"quantization_config.activation_scheme: {scheme!r}; allowed: dynamic, static")
    block = q.get("weight_block_size")
    if block is None:  # per-tensor FP8 (quant_method fp8 without blocks, as vLLM writes it)
        return WeightQuantization("fp8", "tensor", ignore=_ignore(q, "ignored_layers"), dynamic_activations=False)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise QuantizationError(
            f"quantization_config.weight_block_size: {block!r}; allowed: two integers >= 1 (rows, columns)"
        )
    return WeightQuantization(
        "fp8", "block", (block[0], block[1]), _ignore(q, "ignored_layers"), dynamic_activations=scheme == "dynamic"
    )


def _compressed_tensors(q: dict[str, Any]) -> WeightQuantization:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(
            f"quantization_config.format: {fmt!r}; allowed: float-quantized (FP8 weights; packed integer "
            "formats such as int4 are not supported)"
        )
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise QuantizationError("quantization_config.config_groups: exactly one group allowed (one scheme for all)")
    [group] = groups.values()
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict) or weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise QuantizationError(
            f"quantization_config.config_groups: weights must be 8-bit float (type float, num_bits 8); got {weights!r}"
        )
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise QuantizationError(f"quantization_config weights.strategy: {strategy!r}; allowed: channel, tensor, block")
    block = weights.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
        raise QuantizationError(f"quantization_config weights.block_structure: {block!r}; allowed: two integers")
    activations = group.get("input_activations")
    dynamic = activations is None or bool(activations.get("dynamic", False))
    return WeightQuantization(
        "compressed-tensors",
        strategy,
        tuple(block) if strategy == "block" else None,
        _ignore(q, "ignore"),
        dynamic_activations=dynamic,
    )


def _ignore(q: dict[str, Any], key: str) -> tuple[str, ...]:
    entries = q.get(key) or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise QuantizationError(f"quantization_config.{key}: must be a list of module names or 're:' patterns")
    return tuple(entries)
