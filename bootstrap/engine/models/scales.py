"""The values of a checkpoint's FP8 scales, checked when its headers are (they are small: a row,
a block or a layer each), before any weight is read: a weight scale must be finite and > 0 (it
multiplies the e4m3 weight back); a KV scale must be within ``KV_SCALE_RANGE``."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from bootstrap.engine.models.files import ModelSourceError

# A KV scale is the absolute maximum of a layer's keys (or values) over 448, e4m3's largest value.
# Real FP8-KV checkpoints (llm-compressor, ModelOpt) carry scales of about 1e-3 to a few units:
# keys and values of 16-bit models stay far below float16's 65504 (a scale of 146). Below 1e-6 every
# key over 4.5e-4 saturates; above 1000 every one is a subnormal or 0: either is a broken file.
KV_SCALE_RANGE = (1e-6, 1e3)


def check_weight_scales(scales: list[tuple[Path, str]]) -> None:
    """Each (file, tensor name) of FP8 weight scales finite and > 0, else ``ModelSourceError`` naming it."""
    by_file: dict[Path, list[str]] = {}
    for file, name in scales:
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in names:
                values = reader.get_tensor(name).float()
                bad = ~(values.isfinite() & (values > 0))
                if bad.any():
                    first = values.reshape(-1)[bad.reshape(-1)][0].item()
                    raise ModelSourceError(
                        f"{file}: tensor {name!r} holds {first} at {bad.sum().item()} place(s); "
                        "an FP8 weight scale must be finite and > 0"
                    )


def check_kv_scale(file: Path, name: str, layer: int, value: float) -> float:
    """``value``, the KV scale ``name`` of ``layer``, when in ``KV_SCALE_RANGE``; else ``ModelSourceError``."""
    low, high = KV_SCALE_RANGE
    if not (math.isfinite(value) and low <= value <= high):
        raise ModelSourceError(
            f"{file}: tensor {name!r} (layer {layer}'s FP8 KV scale) is {value}; allowed: {low:g}..{high:g} "
            "(the keys' or values' absolute maximum over 448)"
        )
    return value


def read_scale(reader: safe_open, name: str) -> float:
    """A KV scale tensor's one value (a tensor of several: its first, as the loader always took)."""
    return float(reader.get_tensor(name).to(torch.float64).reshape(-1)[0])
