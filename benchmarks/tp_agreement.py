"""Greedy tokens of ``bootstrap run --tp N`` against ``--tp 1`` on one checkpoint, each a fresh
process: per size, the token ids, how many agree with the first size's (and where they first
differ), the plan each rank agreed on (KV tokens), and spawn to ready. On two GPUs in bfloat16
the sums of the all-reduce run in another order than one device's, so long greedy runs may part;
the figure is reported, not asserted. A run that exits non-zero is counted in ``failures`` (its exit
status, its last line on stderr); then the exit status is 1, with one line on stderr.

    python benchmarks/tp_agreement.py --model /tmp/llama-8b --device cuda --dtype bfloat16 \\
        --tp-sizes 1,2 --max-tokens 256 --out tp_agreement.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import count_failures, failure_exit, int_list

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "w5 w7 w9 w11 w13 w17 w19 w23"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", required=True, help="a checkpoint directory (what --tp N loads)")
    add("--device", default="cpu")
    add("--dtype", default=None, help="the run's --dtype (default: the model's)")
    add("--tp-sizes", default="1,2", type=int_list)
    add("--max-tokens", type=int, default=256)
    add("--prompt", default=PROMPT)
    add("--run-args", default="", help="more flags for every run, one string")
    add("--out", type=Path)
    return parser.parse_args(argv)


def greedy(args: argparse.Namespace, tp: int) -> dict:
    command = [sys.executable, "-m", "bootstrap.cli", "run", "--model", args.model, "--device", args.device]
    command += ["--tp", str(tp), "--prompt", args.prompt, "--max-tokens", str(args.max_tokens)]
    command += ["--temperature", "0", "--no-plan-cache", "--json", *args.run_args.split()]
    command += ["--dtype", args.dtype] if args.dtype else []
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        return {"tp": tp, "exit": done.returncode, "error": (done.stderr.strip().splitlines() or [""])[-1]}
    result = json.loads(done.stdout)
    return {
        "tp": tp,
        "exit": 0,
        "ready_after_spawn_s": result.get("ready_after_spawn_s"),
        "kv_tokens": result["plan"].get("kv_tokens"),
        "token_ids": result["token_ids"],
    }


def agreement(first: list[int], other: list[int]) -> dict:
    differ = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), None)
    same = sum(a == b for a, b in zip(first, other))
    return {"first_difference_at": differ, "equal_positions": same, "of": min(len(first), len(other))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [greedy(args, tp) for tp in args.tp_sizes]
    first = runs[0].get("token_ids") or []
    for run in runs[1:]:
        if run["exit"] == 0:
            run["against_first"] = agreement(first, run["token_ids"])
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens}
    result["runs"] = runs
    result["failures"] = count_failures((f"exit {run['exit']}", run.get("error")) for run in runs)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return failure_exit("tp_agreement", result["failures"], "runs")


if __name__ == "__main__":
    sys.exit(main())
