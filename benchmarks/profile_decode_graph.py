"""Where a captured decode step spends its GPU time: kernels of graph replays, by total time.

Random weights of ``--model``, a KV pool with every row at ``--context`` tokens, one decode
graph per ``--batch-sizes`` entry replayed ``--replays`` times under ``torch.profiler`` (CUPTI
sees the kernels inside graphs). Prints, per batch size, the replay time (CUDA events), the
top kernels, and the share of time in GEMMs, attention and everything else; writes JSON.
``--rows-per-request R`` gives each request ``R`` rows at consecutive positions over one block
table: a speculative verify pass at ``R = k + 1``, a draft pass catching up at 2.

    python benchmarks/profile_decode_graph.py --model random:llama-3.1-8b --batch-sizes 1,64 --context 288
    python benchmarks/profile_decode_graph.py --batch-sizes 1 --rows-per-request 1,5 --context 512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bootstrap.engine import KVCacheSpec, PagedKVCache, SchedulerConfig, create_executor
from bootstrap.engine.sources.loader import load_model
from bootstrap.engine.step.model_runner import DecodeStep


def classify(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitk")):
        return "gemm"
    if any(
        k in lowered
        for k in ("paged_decode", "attention", "fmha", "flash", "index_select", "index_copy", "indexselect")
    ):
        return "attention"
    return "other"


def rows_step(size: int, per_request: int, context: int, blocks: int, tpb: int) -> DecodeStep:
    """``size`` requests of ``context`` cached tokens, each with ``per_request`` rows at
    positions ``context, context + 1, ...`` over its own block table."""
    ids, positions, slots, tables = [], [], [], []
    for request in range(size):
        table = list(range(request * blocks, (request + 1) * blocks))
        for position in range(context, context + per_request):
            ids.append(7)
            positions.append(position)
            slots.append(table[position // tpb] * tpb + position % tpb)
            tables.append(table)
    return DecodeStep(ids, positions, slots, tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=288)
    parser.add_argument("--rows-per-request", default="1", help="comma-separated; each is profiled at each batch size")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--compile-norms", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    per_request = [int(r) for r in args.rows_per_request.split(",")]
    loaded = load_model(args.model, device=torch.device("cuda"), dtype=torch.bfloat16)
    tpb, seq_len = 32, args.context + 64
    spec = KVCacheSpec.from_config(loaded.hf_config, torch.bfloat16)
    cache = PagedKVCache.from_tokens(spec, max(sizes) * (seq_len + tpb), tpb, "cuda")
    rows_max = max(sizes) * max(per_request)
    ex = create_executor(loaded.model, cache, SchedulerConfig(rows_max, rows_max * 64, seq_len), start=False)
    ex.runner.decode_kernel = ex.runner._decode_kernel(args.kernel)
    shapes = [(size, r) for size in sizes for r in per_request]
    capture = ex.runner.capture_decode_graphs(
        sorted({size * r for size, r in shapes}), compile_norms={"yes": True, "no": False}.get(args.compile_norms)
    )
    blocks = -(-(args.context + max(per_request)) // tpb)
    report = {
        "model": args.model,
        "context": args.context,
        "kernel": ex.runner.decode_kernel,
        "compile_norms": args.compile_norms,
        "widths": capture.widths,
        "results": [],
    }
    for size, r in shapes:
        step = rows_step(size, r, args.context, blocks, tpb)
        bucket = ex.runner.graphs.bucket(step.size, blocks)
        ex.runner.decode_buffers.fill(step, bucket[0])
        for _ in range(3):
            ex.runner.graphs.replay(bucket)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            ex.runner.graphs.replay(bucket)
        end.record()
        end.synchronize()
        step_ms = start.elapsed_time(end) / args.replays
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                ex.runner.graphs.replay(bucket)
            torch.cuda.synchronize()
        kernels = [
            (e.key, e.device_time_total / args.replays / 1000, e.count // args.replays)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ]
        kernels.sort(key=lambda k: -k[1])
        shares: dict[str, float] = {}
        for name, ms, _ in kernels:
            shares[classify(name)] = shares.get(classify(name), 0.0) + ms
        row = {
            "batch_size": size,
            "rows_per_request": r,
            "step_ms": round(step_ms, 3),
            "kernels_per_step": sum(k[2] for k in kernels),
            "ms_by_class": {k: round(v, 3) for k, v in shares.items()},
            "top": [{"kernel": n[:90], "ms": round(ms, 3), "count": c} for n, ms, c in kernels[:15]],
        }
        print(json.dumps(row, indent=1), flush=True)
        report["results"].append(row)
    ex.shutdown()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
