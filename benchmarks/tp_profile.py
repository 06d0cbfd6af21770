"""Where a decode step's time goes at ``--tp N``: the all-reduces against the rest, per rank.

For each of ``--tp-sizes``, fresh ranks under torch's launcher (as ``bootstrap run --tp N``)
build the executor through the stages on ``--model`` (CUDA graphs captured on CUDA unless
``--no-cuda-graphs``), then each rank runs the same decode steps of every ``--batch-sizes`` entry,
its rows at ``--context`` cached tokens, through its runner (a graph replay where one covers the
step): the step time over ``--steps`` steps, then the same steps under ``torch.profiler``. The
all-reduce time of a step: on CUDA the device time of NCCL's kernels (CUPTI sees them inside
graphs); on the CPU the time of gloo's ``gloo:all_reduce`` on its worker thread (waiting for the
peer included, as NCCL's kernels wait on the device). The count per step is reported next to the
model's row-parallel projections (one all-reduce each). Writes JSON.

    python benchmarks/tp_profile.py --model /tmp/llama-8b --device cuda --dtype bfloat16 \\
        --tp-sizes 1,2 --batch-sizes 1,16,64 --context 512 --out tp_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, profile_decode_graph

import anyio
import torch
from bench_common import int_list
from profile_decode_graph import rows_step
from torch.profiler import ProfilerActivity, profile

from bootstrap.api import Bootstrap
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.config import BootstrapConfig
from bootstrap.engine.layers.linear import RowLinear
from bootstrap.parallel.launch import launch
from bootstrap.parallel.torch_dist import RankEnv, init_ranks, leave_ranks

ALL_REDUCE_CPU = "gloo:all_reduce"  # gloo's all-reduce on its worker thread, from its start to its end


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", required=True, help="a checkpoint directory, or random:<preset|config.json>")
    add("--device", default="cpu")
    add("--dtype", default=None, help="default: the model's")
    add("--tp-sizes", default="1,2", type=int_list)
    add("--batch-sizes", default="1,16,64", type=int_list)
    add("--context", type=int, default=512, help="cached tokens of every row")
    add("--steps", type=int, default=50, help="decode steps timed, and as many profiled")
    add("--no-cuda-graphs", action="store_true")
    add("--timeout-s", type=float, default=600.0, help="every collective's")
    add("--out", type=Path)
    return parser.parse_args(argv)


def rank_main(args: argparse.Namespace, tp: int, out: str) -> int:
    """One rank: build, measure, write ``rank<r>.json`` under ``out``."""
    env = RankEnv.from_env()
    collective = init_ranks(env, args.device, args.timeout_s)
    try:
        result = anyio.run(_measure, args, tp, collective)
    finally:
        leave_ranks()
    (Path(out) / f"rank{env.rank}.json").write_text(json.dumps({"rank": env.rank, **result}))
    return 0


async def _measure(args: argparse.Namespace, tp: int, collective) -> dict:
    context, sizes = args.context, args.batch_sizes
    config = BootstrapConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype or "auto",
        tensor_parallel_size=tp,
        max_batch_size=max(sizes),
        max_seq_len=context + 64,
        cuda_graphs=not args.no_cuda_graphs,
        plan_cache=None,
    )
    boot = Bootstrap(config, backend=NativeBackend.for_config(config, collective=collective))
    try:
        executor = await boot.build()
        runner = executor.runner
        tpb = runner.kv_cache.tokens_per_block
        blocks = -(-(context + 1) // tpb)
        if max(sizes) * blocks > runner.kv_cache.num_blocks:
            raise SystemExit(f"--context {context} x --batch-sizes {max(sizes)} does not fit the KV pool")
        row_linears = sum(isinstance(m, RowLinear) for m in runner.model.modules()) if tp > 1 else 0
        results = [_profile(runner, rows_step(size, 1, context, blocks, tpb), args.steps) for size in sizes]
        return {"graphs": runner.graphs is not None, "row_parallel_projections": row_linears, "results": results}
    finally:
        await boot.aclose()


def _profile(runner, step, steps: int) -> dict:
    device = runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    for _ in range(3):
        runner.run_rows(step)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        runner.run_rows(step)
    sync(device)
    step_ms = (time.perf_counter() - start) * 1000 / steps
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            runner.run_rows(step)
        sync(device)
        profiled_ms = (time.perf_counter() - start) * 1000 / steps
    if cuda:
        reduces = [e for e in prof.key_averages() if e.device_time_total > 0 and "nccl" in e.key.lower()]
        reduce_us = sum(e.device_time_total for e in reduces)
    else:
        reduces = [e for e in prof.key_averages() if e.key == ALL_REDUCE_CPU]
        reduce_us = sum(e.cpu_time_total for e in reduces)
    reduce_ms = reduce_us / 1000 / steps
    return {
        "batch_size": step.size,
        "step_ms": round(step_ms, 4),
        "profiled_step_ms": round(profiled_ms, 4),  # the same steps under the profiler
        "all_reduce_ms": round(reduce_ms, 4),
        "all_reduce_share": round(reduce_ms / profiled_ms, 4) if profiled_ms else None,  # of the profiled step
        "all_reduces_per_step": sum(e.count for e in reduces) / steps,
        "tokens_per_s": round(step.size * 1000 / step_ms, 1) if step_ms else None,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = {"model": args.model, "device": args.device, "dtype": args.dtype, "context": args.context, "runs": []}
    for tp in args.tp_sizes:
        with tempfile.TemporaryDirectory(prefix="tp-profile-") as out:
            launched = launch(rank_main, (args, tp, out), tp)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        run = {"tp": tp, "exit_codes": launched.codes, "raised": launched.raised, "ranks": ranks}
        report["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "ranks"}), flush=True)
        for rank in ranks:
            for row in rank["results"]:
                print(f"tp {tp} rank {rank['rank']} {json.dumps(row)}", flush=True)
    base = {r["batch_size"]: r["step_ms"] for r in report["runs"][0]["ranks"][0]["results"]} if report["runs"] else {}
    for run in report["runs"]:
        for rank in run["ranks"]:
            for row in rank["results"]:
                if base.get(row["batch_size"]):
                    row["speedup_over_first"] = round(base[row["batch_size"]] / row["step_ms"], 3)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(not run["raised"] and len(run["ranks"]) == run["tp"] for run in result["runs"]) else 1)
