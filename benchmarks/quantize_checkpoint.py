"""Write a 16-bit checkpoint directory's FP8 twin in one of the layouts users download:
``channel`` (compressed-tensors float-quantized, one scale per output row, dynamic per-token
activations: the FP8 releases of Llama 3.1) or ``block`` (``quant_method: "fp8"``, 128 x 128
``weight_scale_inv`` blocks: Qwen3's and DeepSeek's). The attention and MLP projections are
quantized (on ``--device``), everything else is copied as it is; ``lm_head`` stays 16-bit.

    python benchmarks/quantize_checkpoint.py --source /tmp/llama-8b --out /tmp/llama-8b-block \
        --layout block --device cuda

Prints one JSON line: the directory, its size in bytes and the seconds the write took.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 128
CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and its float32 scales (multipliers: weight ~ q * scale)."""
    w = weight.float()
    if layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(FP8).max
        return (w / scale).to(FP8), scale
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK, device=w.device)
    padded[:rows, :cols] = w
    tiles = padded.view(br, BLOCK, bc, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(FP8).view(br * BLOCK, bc * BLOCK)
    return q[:rows, :cols].contiguous(), scale


def write(source: Path, out: Path, layout: str, device: torch.device) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for extra in source.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(extra, out / extra.name)
    weight_map = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(file), framework="pt", device=str(device)) as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not iterable
                tensor = reader.get_tensor(name)
                module = name.rpartition(".")[0]
                if name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS:
                    q, scale = quantize(tensor, layout)
                    suffix = "weight_scale" if layout == "channel" else "weight_scale_inv"
                    tensors[name], tensors[f"{module}.{suffix}"] = q.cpu(), scale.cpu()
                else:
                    tensors[name] = tensor.cpu()
        save_file(tensors, out / file.name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file.name)
    if (source / "model.safetensors.index.json").exists():
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = CHANNEL_CONFIG if layout == "channel" else BLOCK_CONFIG
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a 16-bit checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="the FP8 checkpoint directory to write")
    parser.add_argument("--layout", choices=("channel", "block"), required=True)
    parser.add_argument("--device", default="cpu", help="where the weights are quantized: cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    write(args.source, args.out, args.layout, torch.device(args.device))
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(json.dumps({"checkpoint": str(args.out), "bytes": size, "write_s": round(time.perf_counter() - start, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
