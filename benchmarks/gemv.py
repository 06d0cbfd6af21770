"""The one-row linear kernel (``bootstrap.engine.kernels.gemv``) against cuBLAS, side by side.

For each model shape and each of its matrices (fused q/k/v, o, fused gate/up, down, the
output head): microseconds per one-row product inside a CUDA graph, for torch's ``F.linear``
(cuBLAS) and for the kernel's tile, the bandwidth the faster reached, and each one's largest
error against a float64 product. The graph cycles through enough copies of the weight that L2
holds none of them when it is read, as in a model's pass. ``--sweep`` also times a grid of
tiles and reports the five fastest, which is how the kernel's tile was picked. Needs CUDA and
Triton.

    python benchmarks/gemv.py --models llama-3.2-1b,llama-3.1-8b --sweep --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import emit, graph_replay_us, ratio, report_header, save

from bootstrap.capacity.presets import preset_shape
from bootstrap.engine.kernels import gemv

ROTATE_BYTES = 400 << 20  # the weight copies a graph cycles through: well past the H200's 50 MB of L2


def matrices(model: str) -> dict[str, tuple[int, int]]:
    """Each projection's ``(out, in)`` features for a preset's shape (one rank)."""
    s = preset_shape(model)
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return {
        "qkv": (qkv, s.hidden_size),
        "o": (s.hidden_size, s.num_heads * s.head_dim),
        "gate_up": (2 * s.intermediate_size, s.hidden_size),
        "down": (s.hidden_size, s.intermediate_size),
        "lm_head": (s.vocab_size, s.hidden_size),
    }


def per_call_us(call, weights: list[torch.Tensor], replays: int) -> float:
    """Microseconds per ``call(weight)``, one call per copy captured in one graph, replayed."""
    return round(graph_replay_us(lambda: [call(w) for w in weights], replays) / len(weights), 2)


def sweep_tiles() -> list[tuple[int, int]]:
    """``(block_n, block_k)`` tiles whose partial sums fit a program's registers."""
    return [(n, k) for n, k in itertools.product((4, 8, 16), (512, 1024, 2048)) if n * k <= 16384]


def measure(name: str, shape: tuple[int, int], args: argparse.Namespace) -> dict:
    n, k = shape
    weight_bytes = n * k * 2
    copies = max(2, -(-ROTATE_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    reference = x.double() @ weights[0].double().T
    error = lambda out: (out.double() - reference).abs().max().item()  # noqa: E731
    row = {
        "matrix": name,
        "out_features": n,
        "in_features": k,
        "weight_mb": round(weight_bytes / 1e6, 1),
        "tile": [gemv.BLOCK_N, gemv.BLOCK_K],
        "cublas_us": per_call_us(lambda w: F.linear(x, w), weights, args.replays),
        "kernel_us": per_call_us(lambda w: gemv.linear(x, w), weights, args.replays),
        "cublas_max_error": error(F.linear(x, weights[0])),
        "kernel_max_error": error(gemv.linear(x, weights[0])),
    }
    if args.sweep:
        timed = [
            (per_call_us(lambda w, t=t: gemv.linear(x, w, *t), weights, args.replays), list(t)) for t in sweep_tiles()
        ]
        row["sweep_top"] = sorted(timed)[:5]
    row["best_gb_per_s"] = round(weight_bytes / min(row["cublas_us"], row["kernel_us"]) / 1e3, 1)
    row["speedup"] = ratio(row["cublas_us"], row["kernel_us"])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles and report the five fastest")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or gemv.triton is None:
        raise SystemExit("needs CUDA and Triton")
    report = {**report_header("gemv", argv, torch.device("cuda")), "results": []}
    for model in args.models.split(","):
        for name, shape in matrices(model).items():
            report["results"].append({"model": model, **measure(name, shape, args)})
            print(report["results"][-1], flush=True)
            save(report, args.out)
            torch.cuda.empty_cache()
    emit(report, args.out)


if __name__ == "__main__":
    main()
