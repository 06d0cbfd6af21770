"""A 16-bit checkpoint directory rewritten with FP8 projections in either layout, and the same
weights dequantized back (what an FP8 checkpoint's tokens must equal); a checkpoint with FP8 KV
scales."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}


def _block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(br, block, bc, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max  # [br, bc]
    q = (tiles / scale[:, None, :, None]).to(FP8).view(br * block, bc * block)[:rows, :cols].contiguous()
    return q, scale


def quantized(
    source: Path, target: Path, layout: str, block: int = 16, tensor_scale: torch.dtype = torch.bfloat16
) -> tuple[Path, Path]:
    """``target`` (FP8, ``layout`` "channel", "tensor" or "block") and ``target``-dequantized;
    ``tensor_scale``: the dtype a per-tensor scale is stored in."""
    plain = target.with_name(target.name + "-dequantized")
    for path in (target, plain):
        shutil.copytree(source, path)
    tensors = load_file(source / "model.safetensors")
    fp8, back = {}, {}
    for name, w in tensors.items():
        module = name.rpartition(".")[0]
        if not name.endswith(".weight") or module.rpartition(".")[2] not in PROJECTIONS:
            fp8[name] = back[name] = w
            continue
        if layout == "block":
            q, scale = _block(w, block)
            fp8[name], fp8[f"{module}.weight_scale_inv"] = q, scale
            full = scale.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
        else:  # one scale per row, or one for the whole tensor (bfloat16 by default, as some checkpoints store it)
            w32 = w.float()
            amax = w32.abs().amax(dim=1, keepdim=True) if layout == "channel" else w32.abs().amax().reshape(1)
            scale = amax.clamp(min=1e-12) / torch.finfo(FP8).max
            stored = scale if layout == "channel" else scale.to(tensor_scale)
            q = (w32 / stored.float()).to(FP8)
            fp8[name], fp8[f"{module}.weight_scale"] = q, stored
            full = stored.float()
        back[name] = (q.float() * full).to(w.dtype)
    save_file(fp8, target / "model.safetensors", metadata={"format": "pt"})
    save_file(back, plain / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((source / "config.json").read_text())
    if layout == "block":
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        }
    else:
        groups = json.loads(json.dumps(CHANNEL["config_groups"]))
        groups["group_0"]["weights"]["strategy"] = layout
        cfg["quantization_config"] = {**CHANNEL, "config_groups": groups}
    (target / "config.json").write_text(json.dumps(cfg))
    return target, plain


def with_kv_scales(source: Path, target: Path, scale: float, layers: int, value_scale: float | None = None) -> Path:
    """``source`` with every layer's ``self_attn.k_scale`` set to ``scale`` and its ``v_scale`` to
    ``value_scale`` (None: ``scale``)."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    for i in range(layers):
        for kind, value in (("k_scale", scale), ("v_scale", scale if value_scale is None else value_scale)):
            tensors[f"model.layers.{i}.self_attn.{kind}"] = torch.tensor(value)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target
