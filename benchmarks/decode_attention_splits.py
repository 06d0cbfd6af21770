"""The paged decode kernel, whole rows against rows split in runs, side by side in one process.

For each row count and context length: one layer's attention of a model shape (``--heads``
query heads on ``--kv-heads`` KV heads of ``--head-dim``) over a table as wide as
``--max-context`` needs, captured as a CUDA graph and replayed; microseconds per call (CUDA
events over ``--replays`` replays) with ``splits`` forced to 1, with the count ``num_splits``
picks, and with each of ``--splits``; then the chosen count's speedup over whole rows. Needs
CUDA and Triton.

    python benchmarks/decode_attention_splits.py --rows 1,5,8,32,64 --contexts 576,4096 --out splits.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_common import emit, graph_replay_us, int_list, ratio, report_header, save

from bootstrap.engine.kernels import paged_kv


def replay_us(call, replays: int) -> float:
    return round(graph_replay_us(call, replays), 2)


def measure(args: argparse.Namespace, rows: int, context: int) -> dict:
    tpb = args.tokens_per_block
    width = -(-args.max_context // tpb)
    kc = torch.randn(rows * width, tpb, args.kv_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(rows * width, device="cuda").view(rows, width)
    lens = torch.full((rows,), context, dtype=torch.long, device="cuda")
    q = torch.randn(rows, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    auto = paged_kv.num_splits(rows * args.kv_heads, width, paged_kv.programs_wanted(q.device))

    def run(splits: int) -> float:
        return replay_us(lambda: paged_kv.paged_decode(q, kc, vc, tables, lens, None, splits=splits), args.replays)

    row = {
        "rows": rows,
        "context": context,
        "table_width": width,
        "auto_splits": auto,
        "whole_us": run(1),
        "auto_us": run(auto),
        "forced_us": {str(s): run(s) for s in args.splits if s != 1},
    }
    row["speedup_auto"] = ratio(row["whole_us"], row["auto_us"])
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not paged_kv.available(torch.device("cuda"), args.tokens_per_block):
        raise SystemExit("needs CUDA and Triton")
    report = {
        **report_header("decode_attention_splits", argv, torch.device("cuda")),
        "shape": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim", "tokens_per_block")},
        "results": [],
    }
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            report["results"].append(measure(args, rows, context))
            print(report["results"][-1], flush=True)
            save(report, args.out)
    emit(report, args.out)


if __name__ == "__main__":
    main()
