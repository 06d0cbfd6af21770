"""Time to ready, per stage, cold and warm (plan cache), against the floor for the same model.

For each model, in one process, ``--repeats`` rounds of measurements, side by side, for each
``--graphs`` setting (CUDA graphs ``off`` and ``on``, the default):

- ``cold``: the stages through the native backend with an empty plan cache: load the weights,
  build and profile the probe, plan, allocate the final pool, capture the decode graphs (graphs
  on), start the executor and serve one smoke request. Time from creating the ``Bootstrap`` to
  the ready executor.
- ``warm``: the same start again with the plan the cold start cached: ``estimation_build`` and
  ``profiling`` are skipped (reason ``plan-cache``).
- ``floor``: the work no start can avoid, done directly with torch: materialize the same
  weights (the same loader), run one forward of ``max_num_tokens`` tokens (transformers' own
  attention, logits of the last token), allocate the pool the cold start planned; with graphs
  on, also capture the same decode graphs on that pool (``capture_s``; the ``floor_s`` of that
  setting includes it), since a start that serves through graphs cannot skip capturing them.

Per model and setting the best of the rounds counts (the first round also pays one-time costs
such as importing the model's transformers module); every sample is kept. Ratios: ``cold /
floor``, ``warm / floor``, ``warm / cold``. Each start writes its trace file under
``--trace-dir`` (render a pair with ``bootstrap trace COLD WARM --png OUT``).

    python benchmarks/startup.py --device cuda --dtype bfloat16 \
        --models random:llama-3.2-1b,random:llama-3.1-8b,random:qwen2.5-14b --out startup.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import (
    emit,
    failure,
    positive_int,
    ratio,
    release_memory,
    report_header,
    resolve_device,
    save,
    synchronize,
)

from bootstrap.api import Bootstrap
from bootstrap.backends.native.loading import DTYPES
from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.cuda_graph_buckets import default_batch_sizes
from bootstrap.config import BootstrapConfig
from bootstrap.engine.executor.create import create_executor
from bootstrap.engine.executor.profile_run import run_dummy_requests
from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.scheduler import SchedulerConfig
from bootstrap.engine.sources.loader import load_hf_config, load_model

DEFAULT_MODELS = "random:llama-3.2-1b,random:llama-3.1-8b,random:qwen2.5-14b"
GOALS = {"cold_over_floor": 1.3, "warm_over_cold": 0.6}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", default=DEFAULT_MODELS, help="comma-separated model sources (random:<preset> at real shapes)")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--dtype", default="auto", choices=["auto", *DTYPES], help="weights; auto: bfloat16 on CUDA, float32 on CPU")
    add("--max-seq-len", type=positive_int, default=8192)
    add("--max-num-tokens", type=positive_int, default=8192)
    add("--max-batch-size", type=positive_int, default=64)
    add("--repeats", type=positive_int, default=2, help="rounds of cold, warm and floor per model; the best counts")
    add("--graphs", default="off,on", help="CUDA graph settings to measure, comma-separated: off, on (CUDA only)")
    add("--trace-dir", type=Path, default=None, help="write every start's trace file here")
    add("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def make_config(source: str, args: argparse.Namespace, plan_cache: Path, graphs: bool) -> BootstrapConfig:
    return BootstrapConfig(
        model=source,
        device=args.device,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=args.max_batch_size,
        plan_cache=plan_cache,
        cuda_graphs=graphs,
    )


async def timed_start(config: BootstrapConfig, device: torch.device, trace_file: Path | None) -> dict[str, Any]:
    """One start to a ready executor, then released; its wall time, stages and plan."""
    release_memory(device)
    start = time.perf_counter()
    boot = Bootstrap(config, trace_file=trace_file)
    try:
        await boot.build()
        ready_s = time.perf_counter() - start
        report = boot.report()
        warmup = boot.pipeline.artifacts.get("warmup")
    finally:
        await boot.aclose()
    del boot
    release_memory(device)
    return {
        "ready_s": round(ready_s, 4),
        "stages": {
            row["id"]: {
                "outcome": row["outcome"],
                "skip_reason": row["skip_reason"],
                "duration_s": round(row["duration_s"], 4),
            }
            for row in report.stages
        },
        "plan": {k: report.plan[k] for k in ("kv_budget_bytes", "kv_tokens", "max_num_tokens", "limited_by")},
        "graphs": {
            "num_graphs": warmup.num_graphs,
            "captured_bytes": warmup.graph_bytes,
            "reserved_bytes": warmup.reserved_bytes,
            "capture_s": round(warmup.capture_s, 4),
        }
        if warmup is not None and warmup.num_graphs
        else None,
        "trace_file": str(trace_file) if trace_file else None,
    }


def floor(source: str, args: argparse.Namespace, device: torch.device, pool_bytes: int, graphs: bool) -> dict[str, Any]:
    """Weights, one pool of ``pool_bytes``, one ``max_num_tokens`` forward over it (a prompt
    through the engine's runner, as profiling runs it) and, ``graphs``, the default buckets'
    decode graphs captured on it: each timed, then freed."""
    release_memory(device)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    start = time.perf_counter()
    weights = load_model(source, device=device, dtype=dtype)
    synchronize(device)
    loaded = time.perf_counter()
    spec = KVCacheSpec.from_config(weights.hf_config, dtype)
    pool = PagedKVCache.from_bytes(spec, pool_bytes, BootstrapConfig.model_fields["tokens_per_block"].default, device)
    synchronize(device)
    allocated = time.perf_counter()
    executor = create_executor(
        weights.model, pool, SchedulerConfig(args.max_batch_size, args.max_num_tokens, args.max_seq_len), start=False
    )
    full, rest = divmod(args.max_num_tokens, args.max_seq_len - 1)  # each prompt leaves room for its sampled token
    run_dummy_requests(executor, [args.max_seq_len - 1] * full + ([rest] if rest else []))
    synchronize(device)
    forward = time.perf_counter()
    if graphs:
        executor.runner.capture_decode_graphs(default_batch_sizes(args.max_batch_size))
    done = time.perf_counter()
    weight_bytes = weights.weight_bytes
    executor.shutdown()  # releases the graphs
    pool.release()
    del pool, weights, executor
    release_memory(device)
    parts = {
        "weights_s": loaded - start,
        "pool_s": allocated - loaded,
        "forward_s": forward - allocated,
        "capture_s": done - forward,
        "floor_s": done - start,
    }
    return {**{k: round(v, 4) for k, v in parts.items()}, "weight_bytes": weight_bytes, "pool_bytes": pool_bytes}


async def one_round(
    source: str, args: argparse.Namespace, device: torch.device, round_no: int, graphs: bool
) -> dict[str, Any]:
    slug = source.removeprefix("random:").replace("/", "_") + ("_graphs" if graphs else "")
    trace = (
        (lambda kind: args.trace_dir / f"{slug}_{kind}_r{round_no}.jsonl") if args.trace_dir else (lambda kind: None)
    )
    with tempfile.TemporaryDirectory(prefix="plans-") as cache:
        config = make_config(source, args, Path(cache), graphs)
        cold = await timed_start(config, device, trace("cold"))
        warm = await timed_start(config, device, trace("warm"))
    pool_bytes = cold["plan"]["kv_budget_bytes"]
    return {"round": round_no, "cold": cold, "warm": warm, "floor": floor(source, args, device, pool_bytes, graphs)}


def shape_record(source: str) -> dict[str, Any]:
    shape = parse_config(load_hf_config(source).to_dict())
    return {
        "architecture": shape.architecture,
        "parameters": shape.parameter_count(),
        "layers": shape.num_layers,
        "heads": shape.num_heads,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
    }


def summarize(source: str, graphs: bool, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    cold = min(rounds, key=lambda r: r["cold"]["ready_s"])["cold"]
    warm = min(rounds, key=lambda r: r["warm"]["ready_s"])["warm"]
    best_floor = min(rounds, key=lambda r: r["floor"]["floor_s"])["floor"]
    return {
        "model": source,
        "cuda_graphs": graphs,
        "shape": shape_record(source),
        "best": {"cold_s": cold["ready_s"], "warm_s": warm["ready_s"], "floor_s": best_floor["floor_s"]},
        "ratios": {
            "cold_over_floor": ratio(cold["ready_s"], best_floor["floor_s"]),
            "warm_over_floor": ratio(warm["ready_s"], best_floor["floor_s"]),
            "warm_over_cold": ratio(warm["ready_s"], cold["ready_s"]),
        },
        "cold": cold,
        "warm": warm,
        "floor": best_floor,
        "rounds": rounds,
    }


async def measure(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    """Every model in turn into ``report["models"]``, saved after each; a model that fails is
    recorded with its error and the next one runs."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for source, graphs in [(m, g) for m in models for g in graph_settings(args.graphs, device)]:
        label = f"{source} graphs {'on' if graphs else 'off'}"
        try:
            rounds = [await one_round(source, args, device, n, graphs) for n in range(1, args.repeats + 1)]
            result = summarize(source, graphs, rounds)
            print(f"startup {label}: {result['best']} {result['ratios']}", file=sys.stderr, flush=True)
        except Exception as exc:  # one model's failure must not lose the others' figures
            result = {"model": source, "cuda_graphs": graphs, **failure(exc)}
            print(f"startup {label}: {result['error']}", file=sys.stderr, flush=True)
            release_memory(device)
        report["models"].append(result)
        save(report, args.out)


def graph_settings(spec: str, device: torch.device) -> list[bool]:
    """``--graphs`` as booleans; only ``off`` on the CPU, where nothing is captured."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names or set(names) - {"on", "off"}:
        raise SystemExit(f"--graphs: {spec!r}; allowed: off, on, or both comma-separated")
    settings = [name == "on" for name in dict.fromkeys(names)]
    return [False] if device.type != "cuda" else settings


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.ones(8, 8, device=device).matmul(torch.ones(8, 8, device=device))  # CUDA context and cuBLAS, untimed
    report = {
        **report_header("startup", argv, device),
        "settings": {
            k: getattr(args, k)
            for k in ("dtype", "max_seq_len", "max_num_tokens", "max_batch_size", "repeats", "graphs")
        },
        "goals": GOALS,
        "models": [],
    }
    anyio.run(measure, args, device, report)
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
