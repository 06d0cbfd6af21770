"""``random:<preset | config.json>``: real model shapes with seeded random weights.

For benchmarks and tests without a checkpoint. The weights are created directly on the target
device (no CPU copy), under a forked RNG so the caller's random state is left untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bootstrap.engine.attention import register

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PREFIX = "random:"


def preset_names() -> list[str]:
    """Names accepted after ``random:`` besides a config.json path."""
    from bootstrap.capacity.presets import MODEL_PRESETS

    return sorted(MODEL_PRESETS)


def config_dict(spec: str) -> dict[str, Any]:
    """A fresh config dict for a preset name or a config.json path (file or its directory)."""
    from bootstrap.capacity.presets import MODEL_PRESETS

    if spec in MODEL_PRESETS:
        return json.loads(json.dumps(MODEL_PRESETS[spec]))  # deep copy: presets stay untouched
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    raise ValueError(
        f"model source 'random:{spec}': {spec!r} is neither a preset nor a config.json path; "
        f"presets: {', '.join(preset_names())}"
    )


def random_config(spec: str) -> PretrainedConfig:
    """The transformers config for ``random:<spec>``."""
    from transformers import AutoConfig

    values = config_dict(spec)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ValueError(f"model source 'random:{spec}': the config has no 'model_type'")
    return AutoConfig.for_model(model_type, **values)


def random_model(
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype | None,
    attn_implementation: str | None,
    seed: int,
) -> torch.nn.Module:
    """A causal LM with ``config``'s shapes and seeded random weights, built on ``device``."""
    from transformers import AutoModelForCausalLM

    register()
    kwargs: dict[str, Any] = {"dtype": dtype or _config_dtype(config)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    forked = [_cuda_index(device)] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=device.type):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, torch.dtype):
        return stored
    if isinstance(stored, str) and isinstance(getattr(torch, stored, None), torch.dtype):
        return getattr(torch, stored)
    return torch.float32
