"""``random:<preset | config.json>``: real model shapes with seeded random weights.

For benchmarks and tests without a checkpoint. The weights are created directly on the target
device (no CPU copy), under a forked RNG so the caller's random state is left untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bootstrap.engine.layers.attention import ATTN_IMPLEMENTATION, register
from bootstrap.engine.sources.random_spec import preset_names

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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


def load_random(
    spec: str, device: torch.device, dtype: torch.dtype | None, attn_implementation: str | None, seed: int
) -> torch.nn.Module:
    """The model of ``random:<spec>``: in the engine's own model code for the families it runs
    (no transformers import), else through transformers."""
    from bootstrap.engine.models import own_model_problem

    values = config_dict(spec)
    if attn_implementation in (None, ATTN_IMPLEMENTATION) and own_model_problem(values) is None:
        model = own_random_model(values, device, dtype, seed)
        if model is not None:
            return model
    return random_model(random_config(spec), device, dtype, attn_implementation, seed)


def own_random_model(
    values: dict[str, Any], device: torch.device, dtype: torch.dtype | None, seed: int
) -> torch.nn.Module | None:
    """The own-code model of ``values`` with seeded random weights drawn on ``device``, as
    transformers initialises them (normal with the config's ``initializer_range``, zero biases,
    norms at their identity); None for a config the own code cannot read."""
    from bootstrap.capacity.shape import ModelConfigError
    from bootstrap.engine.layers.norm import RMSNorm
    from bootstrap.engine.models import build_own_model

    try:
        model = build_own_model(values, device, dtype)
    except ModelConfigError:
        return None
    std = float(values.get("initializer_range", 0.02))
    forked = [_cuda_index(device)] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=device.type), torch.no_grad():
        torch.manual_seed(seed)
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):  # a tied head redraws the embeddings
                if isinstance(module, RMSNorm):
                    param.fill_(1.0 - module.offset)
                elif name == "weight":
                    param.normal_(0.0, std)
                else:
                    param.zero_()
    return model.eval()


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
