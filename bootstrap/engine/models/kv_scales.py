"""A checkpoint's FP8 KV scales (``KV_SCALES`` per layer, each checked) and the ones a loaded model
carries for its e4m3 pools (``KVScales``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from bootstrap.engine.models.files import ModelSourceError
from bootstrap.engine.models.scales import check_kv_scale, read_scale
from bootstrap.engine.models.weights import KV_SCALES, stored_tensors


@dataclass
class KVScales:
    """The per-layer key and value scales of the checkpoint a model's weights came from, for an
    e4m3 pool (None: it has none; 1.0 is used). One per loaded model: new weights read in place
    bring theirs (``replace``), and the pools take them when an executor starts."""

    keys: list[float] | None = None
    values: list[float] | None = None

    @property
    def source(self) -> str:
        return "checkpoint" if self.keys is not None else "1.0"

    def replace(self, scales: tuple[list[float], list[float]] | None) -> None:
        self.keys, self.values = scales if scales is not None else (None, None)


def checkpoint_kv_scales(files: list[Path], num_layers: int) -> tuple[list[float], list[float]] | None:
    """The keys' and values' scales of every layer (``KV_SCALES``), or None when the checkpoint
    has none; ``ModelSourceError`` when only some layers have them."""
    found: dict[tuple[int, int], tuple[Path, str]] = {}
    for file in files:
        for stored in stored_tensors(file):
            for suffix, kind in KV_SCALES.items():
                prefix = stored.name.removesuffix("." + suffix)
                if prefix != stored.name and prefix.rpartition(".")[2].isdigit():
                    found[(kind, int(prefix.rpartition(".")[2]))] = (file, stored.name)
    if not found:
        return None
    missing = [(k, i) for k in (0, 1) for i in range(num_layers) if (k, i) not in found]
    if missing:
        kind, layer = missing[0]
        raise ModelSourceError(f"the checkpoint has no {'kv'[kind]}_scale for layer {layer}, but has some for others")
    scales: list[list[float]] = [[0.0] * num_layers, [0.0] * num_layers]
    for (kind, layer), (file, name) in sorted(found.items(), key=lambda item: item[0][::-1]):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            scales[kind][layer] = check_kv_scale(file, name, layer, read_scale(reader, name))
    return scales[0], scales[1]
