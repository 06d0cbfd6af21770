"""Triton's first compile of the engine's kernels for a model's shapes, spread four ways.

What ``engine.models.compile_ahead`` launches while a start reads the weights, each way in a
fresh process with a Triton cache of its own, after torch, CUDA and Triton's start: the seconds
from the first launch to the last kernel done, and the process's CPU seconds (its own, and its
children's: ``ptxas``), for
- ``serial``: one launch after another in one thread, each launch's seconds recorded;
- ``by_kernel``: a thread per kernel function, its launches in turn;
- ``by_specialization``: a thread per kernel, split count and row tile (``compile_ahead``'s way);
- ``by_launch``: a thread per launch.
Then the same launches in a fresh process on the cache one way filled (``warm``: loads only).
The model is built on the meta device: no weights, only the shapes. Needs CUDA and Triton.

    python benchmarks/kernel_compile.py --shape llama-3.1-8b --repeats 2 --out kernel_compile.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import emit, report_header, save

WAYS = ("serial", "by_kernel", "by_specialization", "by_launch")


def child(way: str, shape: str, quantize: str | None) -> dict:
    """In this fresh process: the launches ``way`` spreads, timed."""
    import torch

    from bootstrap.capacity.presets import preset_config
    from bootstrap.engine.kernels import triton_start
    from bootstrap.engine.models import build_own_model
    from bootstrap.engine.models.compile_ahead import _calls, _launch, _launch_each, _specialization

    triton_start.begin()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.zeros(1, device=device)
    triton_start.wait()
    cfg = json.loads(Path(shape).read_text()) if shape.endswith(".json") else preset_config(shape)
    model = build_own_model(cfg, torch.device("meta"), dtype, quantize=quantize)
    calls = sorted(set(_calls(model)), key=lambda call: (str(_specialization(call)), str(call)))
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start, each = time.perf_counter(), []
    if way in ("serial", "warm"):
        for call in calls:
            began = time.perf_counter()
            _launch(call, dtype, device)
            torch.cuda.synchronize()
            each.append({"launch": list(call), "s": round(time.perf_counter() - began, 3)})
    else:
        key = {"by_kernel": lambda call: call[0], "by_specialization": _specialization, "by_launch": tuple}[way]
        groups = [list(group) for _, group in itertools.groupby(calls, key=key)]
        with ThreadPoolExecutor(len(groups)) as pool:
            for future in [pool.submit(_launch_each, group, dtype, device, None) for group in groups]:
                future.result()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = [round(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime, 2) for a, b in zip(after, before)]
    import triton

    return {
        "way": way,
        "launches": len(calls),
        "wall_s": round(wall, 3),
        "cpu_s": cpu[0],
        "children_cpu_s": cpu[1],
        "triton": triton.__version__,
        "each": each,
    }


def run_way(way: str, args: argparse.Namespace, cache: Path) -> dict:
    command = [sys.executable, __file__, "--child", way, "--shape", args.shape]
    command += ["--quantize", args.quantize] if args.quantize else []
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        return {"way": way, "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", help="a preset or a config.json")
    parser.add_argument("--quantize", choices=("fp8",), help="the projections in FP8 (their kernels too)")
    parser.add_argument("--repeats", type=int, default=1, help="each way this many times, each on an empty cache")
    parser.add_argument("--child", choices=(*WAYS, "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.shape, args.quantize)))
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    report = {**report_header("kernel_compile", argv, torch.device("cuda")), "shape": args.shape, "runs": []}
    with tempfile.TemporaryDirectory(prefix="kernel-compile-") as work:
        for repeat, way in itertools.product(range(args.repeats), WAYS):
            cache = Path(work) / f"{way}-{repeat}"
            report["runs"].append(run_way(way, args, cache))
            print(json.dumps({k: v for k, v in report["runs"][-1].items() if k != "each"}), flush=True)
            save(report, args.out)
        report["runs"].append(run_way("warm", args, Path(work) / "serial-0"))
    emit(report, args.out)
    return 1 if any("error" in run for run in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
