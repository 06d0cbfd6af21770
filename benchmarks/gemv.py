"""The few-row linear kernel (``bootstrap.engine.layers.gemv``) against cuBLAS, side by side.

For each model shape and each of its matrices (fused q/k/v, o, fused gate/up, down, the
output head) and each row count: microseconds per product inside a CUDA graph, for torch's
``F.linear`` (cuBLAS) and for the kernel with the tile ``choose`` picks, and the time the
weight's bytes take at the bandwidth the best of them reached (the table's ``GB/s``). The graph
cycles through enough copies of the weight that L2 holds none of them when it is read, as in a
model's pass. ``--sweep`` also times every tile of a small grid and reports the best, which is
how ``choose``'s numbers were picked. Needs CUDA and Triton.

    python benchmarks/gemv.py --models llama-3.2-1b,llama-3.1-8b --rows 1,2,5,8 --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import emit, ratio, report_header, save

from bootstrap.capacity.presets import preset_shape
from bootstrap.engine.layers import gemv

ROTATE_BYTES = 400 << 20  # the weight copies a graph cycles through: well past the H200's 50 MB of L2


def matrices(model: str) -> dict[str, tuple[int, int]]:
    """Each projection's ``(out, in)`` features for a preset's shape (one rank)."""
    s = preset_shape(model)
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return {"qkv": (qkv, s.hidden_size), "o": (s.hidden_size, s.num_heads * s.head_dim),
            "gate_up": (2 * s.intermediate_size, s.hidden_size), "down": (s.hidden_size, s.intermediate_size),
            "lm_head": (s.vocab_size, s.hidden_size)}  # fmt: skip


def per_call_us(call, weights: list[torch.Tensor], replays: int) -> float:
    """Microseconds per ``call(weight)``, one call per copy captured in one graph, replayed."""
    for w in weights[:1]:
        call(w)  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) * 1000 / replays / len(weights), 2)


def sweep_tiles(rows: int) -> list[gemv.Tile]:
    """Tiles of both kinds whose partial sums fit a program's registers."""
    if rows > 2:
        grid = itertools.product((16, 32, 64), (64, 128, 256, 512), (1, 2, 4, 8), (2, 4))
        return [gemv.Tile(n, k, s, w, dot=True) for n, k, s, w in grid if n * k <= 16384]
    grid = itertools.product((4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8), (2, 4, 8))
    return [gemv.Tile(n, k, s, w) for n, k, s, w in grid if n * k * rows <= 16384]


def measure(name: str, shape: tuple[int, int], rows: int, args: argparse.Namespace) -> dict:
    n, k = shape
    weight_bytes = n * k * 2
    copies = max(2, -(-ROTATE_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    sms = gemv.streaming_multiprocessors(x.device)
    tile = gemv.choose(rows, n, k, sms)
    reference = x.double() @ weights[0].double().T
    error = lambda out: (out.double() - reference).abs().max().item()  # noqa: E731
    row = {"matrix": name, "out_features": n, "in_features": k, "rows": rows, "weight_mb": round(weight_bytes / 1e6, 1),
           "tile": tile.__dict__, "cublas_us": per_call_us(lambda w: F.linear(x, w), weights, args.replays),
           "kernel_us": per_call_us(lambda w: gemv.linear(x, w, tile=tile), weights, args.replays),
           "cublas_max_error": error(F.linear(x, weights[0])), "kernel_max_error": error(gemv.linear(x, weights[0]))}  # fmt: skip
    if args.sweep:
        timed = [(per_call_us(lambda w, t=t: gemv.linear(x, w, tile=t), weights, args.replays), t) for t in sweep_tiles(rows)]
        timed.sort(key=lambda pair: pair[0])
        row |= {"sweep_best_us": timed[0][0], "sweep_best_tile": timed[0][1].__dict__,
                "sweep_top": [[us, list(t.__dict__.values())] for us, t in timed[:5]]}  # fmt: skip
    fastest = min(row["cublas_us"], row["kernel_us"], row.get("sweep_best_us", float("inf")))
    row["best_gb_per_s"] = round(weight_bytes / fastest / 1e3, 1)
    row["speedup"] = ratio(row["cublas_us"], row["kernel_us"])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--rows", default="1,2,5,8")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles and report the best")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or gemv.triton is None:
        raise SystemExit("needs CUDA and Triton")
    report = {**report_header("gemv", argv, torch.device("cuda")), "results": []}
    for model in args.models.split(","):
        for name, shape in matrices(model).items():
            for rows in (int(r) for r in args.rows.split(",")):
                report["results"].append({"model": model, **measure(name, shape, rows, args)})
                print(report["results"][-1], flush=True)
                save(report, args.out)
                torch.cuda.empty_cache()
    emit(report, args.out)


if __name__ == "__main__":
    main()
