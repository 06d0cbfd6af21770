"""Weights from a checkpoint directory's safetensors files straight into the engine's own model.

Every checkpoint tensor is read once, in file order, onto the target device and copied into its
final place: a parameter of the same name, or its rows of a fused projection (``q_proj`` of
``qkv_proj``, ``gate_proj`` of ``gate_up_proj``: ``FUSED``). Under tensor parallelism each rank
reads only its slice of a sharded weight (``layers.linear``). The model is built on the meta
device first, so no second full copy of the weights ever exists. A tensor the model does not
have, a parameter no tensor filled, or a shape that differs is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bootstrap.engine.layers.linear import FusedLinear, RowLinear

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # fmt: skip
IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, in the order its index lists them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        return [path / name for name in names]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def load_weights(model: torch.nn.Module, files: list[Path], device: torch.device, dtype: torch.dtype) -> None:
    """Fill every parameter of ``model`` (already on ``device``, in ``dtype``) from ``files``."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head under both names
    modules = dict(model.named_modules())
    filled: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as reader:
            for name in reader.keys():
                if not name.endswith(IGNORED):
                    filled |= _load_one(name, reader.get_slice(name), dtype, params, modules)
    tied = _tied(model)
    if filled & tied:  # the shared tensor came under one of its two names: both are filled
        filled |= tied
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s): {', '.join(missing[:5])}")


def _load_one(name: str, source: Any, dtype: torch.dtype, params: dict, modules: dict) -> set[str]:
    """Read this rank's part of checkpoint tensor ``name`` (a safetensors slice) into its place."""
    owner, _, kind = name.rpartition(".")
    parent, _, part = owner.rpartition(".")
    if part in FUSED:
        fused = f"{parent}.{FUSED[part]}"
        module = modules.get(fused)
        if not isinstance(module, FusedLinear):
            raise ValueError(f"checkpoint tensor {name!r} has no place in this model (no {fused!r})")
        module.load_part(part, kind, source[module.checkpoint_index(part, kind, source.get_shape())].to(dtype))
        return {f"{fused}.{kind}"}
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
    module = modules[owner]
    index = module.checkpoint_index(None, kind, source.get_shape()) if isinstance(module, RowLinear) else ()
    tensor = source[index].to(dtype)
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, the model's {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return {name}


def _tied(model: torch.nn.Module) -> set[str]:
    """The two names of one tensor when the head is tied to the embeddings (checkpoints store
    either name, or both)."""
    head, embed = model.get_output_embeddings().weight, model.model.embed_tokens.weight
    return {"lm_head.weight", "model.embed_tokens.weight"} if head is embed else set()


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint's names, fused projections split back into their
    parts (views, no copies): what a loaded checkpoint held, to compare it with its source."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, kind = name.rpartition(".")
        module = modules[owner]
        if isinstance(module, FusedLinear):
            parent = owner.rpartition(".")[0]
            out |= {f"{parent}.{part}.{kind}": param[rows] for part, rows in module.parts.items()}
        else:
            out[name] = param
    return out
