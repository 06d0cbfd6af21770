"""Write a checkpoint directory with a preset's real shapes and seeded random weights, as a user's
checkpoint sits on disk (config.json, generation_config.json and safetensors shards), so starts
can be measured from a directory instead of ``random:`` weights built in memory.

    python benchmarks/write_checkpoint.py --model llama-3.1-8b --out /tmp/llama-8b --device cuda

Prints one JSON line: the directory, its size in bytes and the seconds the write took.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bootstrap.engine.sources.loader import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a preset or a config.json (what random: takes)")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--device", default="cpu", help="where the random weights are built: cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--shard-size", default="5GB", help="largest safetensors shard, as transformers takes it")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (another seed: other values)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    # Built by transformers (an attention other than the engine's keeps random: there), whose
    # save_pretrained writes the directory as a Hugging Face checkpoint sits on disk.
    loaded = load_model(
        f"random:{args.model}",
        device=torch.device(args.device),
        dtype=getattr(torch, args.dtype),
        attn_implementation="sdpa",
        seed=args.seed,
    )
    loaded.model.save_pretrained(args.out, max_shard_size=args.shard_size)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(json.dumps({"checkpoint": str(args.out), "bytes": size, "write_s": round(time.perf_counter() - start, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
