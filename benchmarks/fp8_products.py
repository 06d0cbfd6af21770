"""FP8 projections (``bootstrap.engine.kernels.fp8_gemm``) against bfloat16 ones, per matrix and
row count, side by side, on CUDA.

For each projection of an 8B shape (fused q/k/v, o, fused gate/up, down) and each row count:
microseconds per product inside a CUDA graph (cycling through enough weight copies that L2 holds
none), for bfloat16 (``layers.linear.project``: the one-row kernel at one row, cuBLAS above) and
for e4m3 weights with row scales and with 128 x 128 block scales (``fp8_gemm.linear``, the product
``fp8_gemm.product`` picks), each weight stream's GB/s and the FP8 side's speedup; from 2 to 64
rows also each product it could take (the weight-only few-rows kernel, and the activation
quantizer with cuBLASLt's FP8 GEMM), which is how ``fp8_gemm.FEW_ROWS`` is picked. ``--sweep
ROWS`` also times a grid of tiles at those row counts (the one-row kernel's at 1, the few-rows
kernel's from 2 to 64) and reports the five fastest per layout, which is how ``fp8_gemm.tile`` and
``FEW_TILE`` are picked. Needs CUDA (8.9+) and Triton.

    python benchmarks/fp8_products.py --rows 1,2,16,64,2048 --sweep 1,16 --out fp8_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch
from bench_common import emit, graph_replay_us, ratio, report_header, save
from gemv import ROTATE_BYTES, matrices

from bootstrap.engine.kernels import fp8_gemm
from bootstrap.engine.layers.linear import project

LAYOUTS = {"channel": None, "block": (128, 128)}


def per_call_us(call, weights: list, replays: int) -> float:
    return round(graph_replay_us(lambda: [call(w) for w in weights], replays) / len(weights), 2)


def fp8_weights(n: int, k: int, block: tuple[int, int] | None, copies: int) -> list[tuple]:
    shape = (math.ceil(n / block[0]), math.ceil(k / block[1])) if block else (n, 1)
    return [
        ((torch.randn(n, k, device="cuda") * 32).to(fp8_gemm.FP8), torch.rand(shape, device="cuda") / 32 + 1e-3)
        for _ in range(copies)
    ]


def measure(name: str, shape: tuple[int, int], rows: int, args: argparse.Namespace) -> dict:
    n, k = shape
    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    plain = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    row = {"matrix": name, "out_features": n, "in_features": k, "rows": rows}
    row["bf16_us"] = per_call_us(lambda w: project(x, w), plain, args.replays)
    row["bf16_gb_per_s"] = round(2 * n * k / row["bf16_us"] / 1e3, 1)
    del plain
    for layout, block in LAYOUTS.items():
        weights = fp8_weights(n, k, block, copies)
        us = per_call_us(lambda w, b=block: fp8_gemm.linear(x, w[0], w[1], b), weights, args.replays)
        row[f"{layout}_us"], row[f"{layout}_gb_per_s"] = us, round(n * k / us / 1e3, 1)
        row[f"{layout}_speedup"] = ratio(row["bf16_us"], us)
        row[f"{layout}_product"] = fp8_gemm.product(x, *weights[0], block)
        if 1 < rows <= 64:  # each product the row count could take
            gemm = "rows" if block is None else "blocks" if fp8_gemm.blockwise_supported(x.device) else "dequantize"
            for kind in ("few_rows", gemm):
                row[f"{layout}_{kind}_us"] = per_call_us(
                    lambda w, b=block, kind=kind: fp8_gemm.linear(x, w[0], w[1], b, kind=kind), weights, args.replays
                )
        if rows in args.sweep:
            row[f"{layout}_sweep_top"] = sweep(x, weights, block, args.replays)
        del weights
        torch.cuda.empty_cache()
    row["blockwise_gemm"] = fp8_gemm.blockwise_supported(torch.device("cuda"))
    return row


def sweep(x: torch.Tensor, weights: list, block: tuple[int, int] | None, replays: int) -> list:
    """The five fastest tiles, ``[us, [BLOCK_N, BLOCK_K]]``, of the kernel ``x``'s rows take."""
    if x.shape[0] == 1:
        kernel, grid = fp8_gemm.one_row, itertools.product((2, 4, 8, 16), (128, 256, 512, 1024))
        tiles = [t for t in grid if t[0] * t[1] <= 8192]
    else:
        kernel, grid = fp8_gemm.few_rows, itertools.product((16, 32, 64), (64, 128, 256, 512))
        tiles = [t for t in grid if t[0] * t[1] <= 16384 and (block is None or t[1] <= block[1])]
    timed = [
        (per_call_us(lambda w, t=t: kernel(x, w[0], w[1], block, None, *t), weights, replays), list(t)) for t in tiles
    ]
    return sorted(timed)[:5]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--rows", default="1,2,16,64,2048")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--sweep", default="", help="row counts at which to time a grid of tiles (1: one-row)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.sweep = {int(r) for r in args.sweep.split(",") if r}
    if not torch.cuda.is_available() or fp8_gemm.triton is None or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs CUDA with FP8 (8.9+) and Triton")
    report = {**report_header("fp8_gemm", argv, torch.device("cuda")), "results": []}
    for name, shape in matrices(args.model).items():
        if name == "lm_head":  # stays 16-bit in FP8 checkpoints
            continue
        for rows in (int(r) for r in args.rows.split(",")):
            report["results"].append(measure(name, shape, rows, args))
            print(report["results"][-1], flush=True)
            save(report, args.out)
    emit(report, args.out)


if __name__ == "__main__":
    main()
