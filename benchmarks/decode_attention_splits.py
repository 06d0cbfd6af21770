"""The paged decode kernel, whole rows against rows split in runs, side by side in one process.

For each row count and context length: one layer's attention of a model shape (``--heads``
query heads on ``--kv-heads`` KV heads of ``--head-dim``) over a table as wide as
``--max-context`` needs, captured as a CUDA graph and replayed; microseconds per call (CUDA
events over ``--replays`` replays) with ``splits`` forced to 1, with the count ``num_splits``
picks, and with each of ``--splits``; then the chosen count's speedup over whole rows. With
``--kv-dtypes bfloat16,fp8`` each row is measured on a cache of each dtype (e4m3: scales 1.0),
with the bytes of K and V read per call and the GB/s of the chosen count, and the speedup of each
dtype over the first. The kernel's defaults aside, ``variants_us`` times the chosen count at one
block an iteration and each ``--blocks-per-step``, with the query's dtype in the dots and, with
``--float16-dots``, an e4m3 cache's in float16. Needs CUDA and Triton.

    python benchmarks/decode_attention_splits.py --rows 1,5,8,32,64 --contexts 576,4096 --out splits.json
    python benchmarks/decode_attention_splits.py --rows 64 --contexts 4096 --kv-dtypes bfloat16,fp8 --out kv.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_common import emit, graph_replay_us, int_list, name_list, ratio, report_header, save

from bootstrap.backends.native.loading import KV_DTYPES as LOADING_KV_DTYPES
from bootstrap.engine.kernels import paged_kv


def replay_us(call, replays: int) -> float:
    return round(graph_replay_us(call, replays), 2)


KV_DTYPES = {name: LOADING_KV_DTYPES[name] for name in ("bfloat16", "fp8")}


def measure(args: argparse.Namespace, rows: int, context: int, kv_dtype: str = "bfloat16") -> dict:
    tpb = args.tokens_per_block
    width = -(-args.max_context // tpb)
    kc = torch.randn(rows * width, tpb, args.kv_heads, args.head_dim, device="cuda").to(KV_DTYPES[kv_dtype])
    vc = torch.randn_like(kc, dtype=torch.float32).to(kc.dtype)
    scales = (torch.ones(1, device="cuda"), torch.ones(1, device="cuda")) if kv_dtype == "fp8" else None
    tables = torch.randperm(rows * width, device="cuda").view(rows, width)
    lens = torch.full((rows,), context, dtype=torch.long, device="cuda")
    q = torch.randn(rows, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    auto = paged_kv.num_splits(rows * args.kv_heads, width, paged_kv.programs_wanted(q.device))

    def run(splits: int, step: int | None = None, dots: torch.dtype | None = None) -> float:
        def call():
            return paged_kv.paged_decode(
                q, kc, vc, tables, lens, None, splits=splits, scales=scales, blocks_per_step=step, dot_dtype=dots
            )

        return replay_us(call, args.replays)

    dots = [q.dtype, *([torch.float16] if args.float16_dots and scales is not None else [])]
    row = {
        "rows": rows,
        "context": context,
        "kv_dtype": kv_dtype,
        "kv_bytes": 2 * rows * context * args.kv_heads * args.head_dim * kc.element_size(),
        "table_width": width,
        "auto_splits": auto,
        "whole_us": run(1),
        "auto_us": run(auto),
        "forced_us": {str(s): run(s) for s in args.splits if s != 1},
        "variants_us": {  # the chosen splits at each blocks-per-step and dots dtype
            f"step{n}_{str(dtype).removeprefix('torch.')}": run(auto, n, dtype)
            for n in dict.fromkeys([1, *args.blocks_per_step])
            for dtype in dots
        },
    }
    row["speedup_auto"] = ratio(row["whole_us"], row["auto_us"])
    row["auto_gb_per_s"] = round(row["kv_bytes"] / row["auto_us"] / 1e3, 1)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,5,8,32,64")
    parser.add_argument("--contexts", default="576,4096")
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--splits", type=int_list, default=[2, 4, 8, 16])
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--blocks-per-step", type=int_list, default=[], help="also the chosen splits at these")
    parser.add_argument("--float16-dots", action="store_true", help="also the chosen splits with float16 dots")
    parser.add_argument("--kv-dtypes", type=name_list(KV_DTYPES), default=["bfloat16"], help="bfloat16, fp8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if any(n < 1 or n & (n - 1) for n in args.blocks_per_step):
        parser.error(f"--blocks-per-step: powers of two from 1, not {args.blocks_per_step}")
    if not torch.cuda.is_available() or not paged_kv.available(torch.device("cuda"), args.tokens_per_block):
        raise SystemExit("needs CUDA and Triton")
    report = {
        **report_header("decode_attention_splits", argv, torch.device("cuda")),
        "shape": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim", "tokens_per_block")},
        "results": [],
    }
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            sides = [measure(args, rows, context, kv_dtype) for kv_dtype in args.kv_dtypes]
            for side in sides[1:]:
                side["speedup_over_" + sides[0]["kv_dtype"]] = ratio(sides[0]["auto_us"], side["auto_us"])
            report["results"].extend(sides)
            print(*sides, sep="\n", flush=True)
            save(report, args.out)
    emit(report, args.out)


if __name__ == "__main__":
    main()
