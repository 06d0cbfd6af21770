"""New weights for a serving model from another checkpoint directory of the same model.

``reload_weights`` checks the directory's config.json against the model's (for the own decoder
every setting that changes its output: a checkpoint with another rope_theta or tying would load
and then answer wrongly), plans the reads (``weights.plan_weights``: a tensor missing or of
another shape refused before any byte is read) and reads them into the parameters in place: the
same storage at the same addresses, so CUDA graphs captured on them stay valid.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.shape import ModelConfigError
from bootstrap.engine.models.decoder import DecoderConfig
from bootstrap.engine.models.files import ModelSourceError, exists, read_json
from bootstrap.engine.models.weights import plan_weights, safetensors_files

UNCOMPARED = ("eos_token_id", "bos_token_id", "torch_dtype")  # stop tokens; the dtype is converted at read


def reload_weights(model: torch.nn.Module, path: Path) -> int:
    """``path``'s weights into ``model``'s parameters once every check passed; the bytes read."""
    path = Path(path)
    if not path.is_dir():
        raise ModelSourceError(f"weights: {path} is not a checkpoint directory")
    config = path / "config.json"
    if not exists(config):
        raise ModelSourceError(f"weights: {path} has no config.json")
    check_same_model(model, read_json(config), config)
    files = safetensors_files(path)
    if not files:
        raise ModelSourceError(f"weights: {path} has no safetensors files")
    reads = plan_weights(model, files)
    reads.read()
    return reads.nbytes


def check_same_model(model: torch.nn.Module, cfg: dict[str, Any], file: Path) -> None:
    """``ModelSourceError`` naming the first setting of config.json (``cfg``, read from ``file``)
    that differs from the model's: every ``DecoderConfig`` field but ``UNCOMPARED`` for the own
    decoder, else model_type and architectures."""
    ours = model.config
    if isinstance(ours, DecoderConfig):
        try:
            theirs = DecoderConfig.from_shape(parse_config(cfg), cfg)
        except ModelConfigError as exc:
            raise ModelSourceError(f"weights: {file}: {exc}") from None
        names = [f.name for f in dataclasses.fields(ours) if f.name not in UNCOMPARED and not f.name.startswith("_")]
        pairs = [(name, getattr(theirs, name), getattr(ours, name)) for name in names]
    else:  # a config without a field (a custom model's) compares nothing there
        names = [name for name in ("model_type", "architectures") if getattr(ours, name, None) is not None]
        pairs = [(name, cfg.get(name), getattr(ours, name)) for name in names]
    for name, new, old in pairs:
        if new != old:
            raise ModelSourceError(f"weights: {file}: {name} {new!r}, the serving model's is {old!r}")
