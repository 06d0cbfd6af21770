"""Where a speculative step's wall time goes on the device: busy, idle, and in which kernels.

The same bootstrap and controlled acceptance as ``speculative.py`` (the draft's passes run, their
proposals replaced by the target's recorded continuation at ``--acceptance``), one point: one
batch, speculative then baseline, each under ``torch.profiler`` (CUDA activity only, so the host
runs at its own pace). For each run: its wall time per step (the engine loop's steps:
speculative steps, or decode steps), the device's busy time per step (the union of its kernels'
intervals) and its idle time (the rest: the host not keeping the device fed), the kernels by
total time, and a window of the timeline from the middle of the run: runs of kernels with no
gap over ``--gap-us`` between them (a graph replay is one), each with its length, kernel count
and the idle gap after it. A speculative step that is as busy as its wall time is bound by its
passes' costs; idle time is the host's.

    python benchmarks/speculative_timeline.py --model /tmp/llama-8b --draft-model random:llama-3.2-1b \\
        --batch 1 --acceptance 0.8 --k 4 --gen-len 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import emit  # noqa: E402
from speculative import StepTimes, build, controlled, timed  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gap-us", type=float, default=10.0)
    parser.add_argument("--window", type=int, default=40, help="kernel runs of the timeline to report")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.batches, args.modes = str(args.batch), "fixed"
    return args


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_runs(intervals: list[tuple[float, float]], gap_us: float) -> list[dict]:
    """Consecutive kernels with no more than ``gap_us`` idle between them, as one run each:
    its length and kernel count, and the idle time after it (µs)."""
    runs: list[dict] = []
    for start, end in sorted(intervals):
        if runs and start - runs[-1]["end"] <= gap_us:
            runs[-1]["end"], runs[-1]["kernels"] = max(end, runs[-1]["end"]), runs[-1]["kernels"] + 1
        else:
            runs.append({"start": start, "end": end, "kernels": 1})
    return [
        {
            "us": round(r["end"] - r["start"], 1),
            "kernels": r["kernels"],
            "idle_after_us": round(nxt["start"] - r["end"], 1) if nxt else None,
        }
        for r, nxt in zip(runs, [*runs[1:], None])
    ]


def kernels(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]


def profiled(executor, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """One timed run under the profiler: wall, device busy, the top kernels, a window of runs."""
    cuda = torch.cuda.is_available()  # off CUDA (a smoke run) the CPU's ops stand in for kernels
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        wall_s, outs = timed(executor, prompts, args.gen_len)
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = kernels(json.loads(path.read_text()))
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in events]
    runs = kernel_runs(intervals, args.gap_us)
    middle = max(0, len(runs) // 2 - args.window // 2)
    return {
        "wall_s": wall_s,
        "outs": outs,
        "busy_s": busy_us(intervals) / 1e6,
        "kernels": len(events),
        "top": [{"kernel": n, "ms": round(sum(d) / 1e3, 3), "count": len(d)} for n, d in ranked[: args.top]],
        "timeline": runs[middle : middle + args.window],
    }


def per_step(run: dict, steps: int) -> dict:
    return {
        "steps": steps,
        "wall_ms_per_step": round(run["wall_s"] / steps * 1e3, 3),
        "busy_ms_per_step": round(run["busy_s"] / steps * 1e3, 3),
        "idle_ms_per_step": round((run["wall_s"] - run["busy_s"]) / steps * 1e3, 3),
        "kernels_per_step": round(run["kernels"] / steps, 1),
        "top": run["top"],
        "timeline": run["timeline"],
    }


def measure(args: argparse.Namespace, executor) -> dict:
    speculator, loop = executor.speculator, executor._loop
    vocab = executor.runner.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    control = controlled(executor, prompts, args.gen_len)[2]
    control.rate, loop.speculator = args.acceptance, speculator
    clock = StepTimes(speculator)
    before = (speculator.stats.proposed, speculator.stats.accepted)
    spec = profiled(executor, prompts, args)
    counts = clock.steps()
    loop.speculator = None
    base = profiled(executor, prompts, args)
    proposed, accepted = speculator.stats.proposed - before[0], speculator.stats.accepted - before[1]
    spec_steps = counts["speculative_steps"] + counts["ordinary_steps"]
    return {
        "batch": args.batch,
        "acceptance_set": args.acceptance,
        "acceptance_measured": round(accepted / proposed, 4) if proposed else None,
        "speedup": round(base["wall_s"] / spec["wall_s"], 3),
        **counts,
        "speculative": per_step(spec, spec_steps),
        "baseline": per_step(base, args.gen_len),
    }


async def run(args: argparse.Namespace) -> dict:
    boot, executor = await build(args, auto=False)
    try:
        return {"cost_ratio": round(executor.speculator.cost, 4), **measure(args, executor)}
    finally:
        await boot.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {
        "command": " ".join(["speculative_timeline.py", *(argv if argv is not None else sys.argv[1:])]),
        "k": args.k,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        **asyncio.run(run(args)),
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
