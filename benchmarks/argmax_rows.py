"""The two-stage argmax (``bootstrap.engine.sampling.argmax``) against ``torch.argmax``, side by side.

For each vocabulary, row count and dtype: microseconds per argmax over ``[rows, vocab]`` inside a
CUDA graph (as a decode step's sampler, a draft pass and a verify pass take it), for
``torch.argmax(dim=-1)`` and for the two stages at the chunk count ``chunks_for`` picks (and, with
``--chunks``, at each listed count that divides the vocabulary), and whether every answer equals
torch's on logits with planted ties. Needs CUDA.

    python benchmarks/argmax_rows.py --vocabs 128256,151936 --rows 1,5,8,32 --chunks 128,256,501,1002
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_common import emit, graph_replay_us, ratio, report_header, save

from bootstrap.engine.sampling.argmax import argmax, chunks_for


def tied_logits(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits where each row's maximum appears twice, far apart (the first must win)."""
    x = torch.randn(rows, vocab, device="cuda").to(dtype)
    top = x.max() + 1
    x[:, vocab // 3], x[:, 2 * vocab // 3] = top, top
    return x


def measure(vocab: int, rows: int, dtype: torch.dtype, extra: list[int], replays: int) -> dict:
    x = tied_logits(rows, vocab, dtype)
    want = x.argmax(dim=-1)
    counts = sorted({chunks_for(vocab), *(c for c in extra if vocab % c == 0)})
    row = {
        "vocab": vocab,
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "chunks_picked": chunks_for(vocab),
        "torch_us": round(graph_replay_us(lambda: x.argmax(dim=-1), replays), 2),
        "two_stage_us": {},
        "equal": {},
    }
    for chunks in counts:
        row["two_stage_us"][chunks] = round(graph_replay_us(lambda c=chunks: argmax(x, c), replays), 2)
        row["equal"][chunks] = bool(torch.equal(argmax(x, chunks), want))
    row["speedup_picked"] = ratio(row["torch_us"], row["two_stage_us"][chunks_for(vocab)])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default="128256,151936,49152")
    parser.add_argument("--rows", default="1,5,8,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--chunks", default="", help="more chunk counts to time, where they divide the vocabulary")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    extra = [int(c) for c in args.chunks.split(",") if c]
    report = {**report_header("argmax_rows", argv, torch.device("cuda")), "results": []}
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                report["results"].append(measure(vocab, rows, dtype, extra, args.replays))
                print(report["results"][-1], flush=True)
                save(report, args.out)
    emit(report, args.out)


if __name__ == "__main__":
    main()
