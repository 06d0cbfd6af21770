"""``bootstrap plan | run | serve | cache``: plan on a simulated GPU, run the real executor, serve it, clear cached plans.

``plan`` runs the whole pipeline on a simulated GPU (a dry-run capacity planner); ``run`` builds
the real executor through the same stages and answers one prompt (``bootstrap/cli_run.py``);
``serve`` answers OpenAI-compatible requests while the stages run behind it (``bootstrap/serve/``).

Exit status: 0 ready; 1 a stage failed (one paragraph on stderr, no traceback); 2 bad input
(an invalid or infeasible configuration, named with the field to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console

from bootstrap.capacity import CapacityError
from bootstrap.cli_run import DEFAULT_PLAN_CACHE, add_cache_args, add_run_args, clear_cache, emit, rank_of, run_command
from bootstrap.cli_tp import launch_ranks, leave, needs_launch, rank_backend
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import GiB
from bootstrap.graph import GraphError
from bootstrap.models.shape import ModelConfigError
from bootstrap.pipeline import StageFailed
from bootstrap.report import stage_rows, stage_table
from bootstrap.runner import make_pipeline, plan_summary
from bootstrap.serve.command import add_serve_args, main_serve
from bootstrap.stages import STAGE_IDS
from bootstrap.telemetry import MissingExtra, make_tracer_provider
from bootstrap.trace_view import add_trace_args, trace_command

FAULTABLE = ("load_model", "estimation_build", "profiling", "final_build", "scheduler_sampler")
BAD_INPUT = (ConfigError, ModelConfigError, CapacityError)  # exit 2, also when a stage finds it
INPUT_ERRORS = (*BAD_INPUT, GraphError, MissingExtra, ValueError)  # raised before the pipeline starts


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _config_args(parser: argparse.ArgumentParser, model_help: str = "preset name, config.json, or checkpoint dir",
                 default_model: str | None = None) -> None:  # fmt: skip
    add = parser.add_argument
    add("--model", required=default_model is None, default=default_model, help=model_help)
    add("--draft-model", help="draft model for two-model speculative decoding")
    add("--tp", dest="tensor_parallel_size", type=int, default=1, help="tensor-parallel size")
    add("--dtype", default="auto", help="weights: auto, float32, bfloat16, float16")
    add("--kv-cache-dtype", default="auto", help="KV cache: auto, float32, bfloat16, float16, fp8")
    add("--max-batch-size", type=int, default=BootstrapConfig.model_fields["max_batch_size"].default)
    add("--max-num-tokens", type=int, default=BootstrapConfig.model_fields["max_num_tokens"].default)
    add("--max-seq-len", type=int, help="default: the model's max_position_embeddings")
    add("--tokens-per-block", type=int, default=BootstrapConfig.model_fields["tokens_per_block"].default)
    add("--free-gpu-memory-fraction", type=float,
        help="TensorRT-LLM's rule: KV gets this share of the memory left after the measured peak "
             "(default: the backend's headroom where it has one, the native engine on CUDA; else 0.9)")  # fmt: skip
    add("--kv-headroom-bytes", type=int,
        help="KV gets all the memory left after the measured peak but this many bytes (instead of a fraction)")
    add("--max-kv-bytes", type=int)
    add("--max-kv-tokens", type=int)
    add("--host-cache-bytes", type=int, default=0)
    add("--plan-cache", type=Path, help="directory of cached plans")
    add("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
        help="do not capture decode steps as CUDA graphs (the warmup stage is skipped, reason disabled)")  # fmt: skip
    add("--cuda-graph-batch-sizes", type=_int_list, metavar="N,N,...",
        help="batch sizes to capture as CUDA graphs (default 1,2,4,8, multiples of 8 up to max_batch_size)")  # fmt: skip


def _backend_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--backend", choices=("native", "trtllm"), default="native",
        help="whose executor and KV pricing: native, or trtllm (TensorRT-LLM's PyExecutor)")  # fmt: skip
    add("--kv-manager", choices=("auto", "v1", "v2"), default="auto",
        help="TensorRT-LLM KV cache manager (--backend trtllm): auto is what TensorRT-LLM picks (V1)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bootstrap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="run every stage on a simulated GPU and print the KV plan")
    _config_args(plan)
    _backend_args(plan)
    plan.add_argument("--gpu", required=True, help="h100-80gb, h200, a100-80gb, a100-40gb, l40s, rtx-4090, or bytes (80GiB)")
    plan.add_argument("--trace-file", type=Path, help="write finished spans as JSON Lines (overwrites the file)")
    plan.add_argument("--otlp", action="store_true", help="also export spans over OTLP (needs the otlp extra)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument("--fault", action="append", default=[], metavar="STAGE:oom[:N]",
                      help="make the first N attempts of STAGE raise a simulated OOM (repeatable)")  # fmt: skip
    run = sub.add_parser("run", help="build the real executor through the stages and answer one prompt")
    _config_args(run, "checkpoint dir, .gguf file, random:<preset|config.json>, or the default", "smollm2-135m-instruct")
    _backend_args(run)
    add_run_args(run)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server; the port opens while the stages run")
    _config_args(serve, "checkpoint dir, .gguf file, random:<preset|config.json>, or the default", "smollm2-135m-instruct")
    _backend_args(serve)
    add_serve_args(serve)
    cache = sub.add_parser("cache", help="manage the plan cache")
    add_cache_args(cache)
    add_trace_args(sub.add_parser("trace", help="a timeline of stages and attempts from --trace-file files"))
    return parser


def config_from_args(args: argparse.Namespace) -> BootstrapConfig:
    values = {k: v for k, v in vars(args).items() if k in BootstrapConfig.model_fields and v is not None}
    if getattr(args, "no_plan_cache", False):
        values.pop("plan_cache", None)
    elif args.command in ("run", "serve"):
        values.setdefault("plan_cache", DEFAULT_PLAN_CACHE)
    return BootstrapConfig.parse(**values)


def parse_fault(text: str) -> tuple[str, int]:
    """``STAGE:oom[:N]`` to (stage, N); errors name the allowed stages."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[1] != "oom":
        raise ValueError(f"--fault {text!r}: expected STAGE:oom or STAGE:oom:N")
    if parts[0] not in FAULTABLE:
        kind = "allocates no device memory" if parts[0] in STAGE_IDS else "is not a stage"
        raise ValueError(f"--fault {text!r}: {parts[0]!r} {kind}; allowed stages: {', '.join(FAULTABLE)}")
    count = parts[2] if len(parts) == 3 else "1"
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--fault {text!r}: N must be an integer >= 1, got {count!r}")
    return parts[0], int(count)


async def run_plan(args: argparse.Namespace) -> tuple[dict[str, Any], StageFailed | None]:
    from bootstrap.backends.sim import SimBackend
    from bootstrap.backends.sim_gpus import sim_device

    config = config_from_args(args)
    faults = [parse_fault(f) for f in args.fault]
    device = sim_device(args.gpu)
    for stage, count in faults:
        device.inject_oom(stage, count)
    memory = InMemorySpanExporter()
    provider = make_tracer_provider(trace_file=args.trace_file, otlp=args.otlp, memory=memory)
    error: StageFailed | None = None
    try:
        pipeline = make_pipeline(config, SimBackend(device), tracer_provider=provider)
        try:
            await pipeline.run()
        except StageFailed as exc:
            error = exc
        finally:
            summary = plan_summary(pipeline.artifacts)
            await pipeline.aclose()  # also after Ctrl-C: no device thread or bytes left behind
    finally:
        provider.shutdown()
    result = {
        "stages": stage_rows(memory.get_finished_spans()),
        "plan": summary,
        "device": {"name": device.name, "total_bytes": device.total, "leaked_bytes": sum(device.live().values())},
        "backend": _backend_summary(config, pipeline.artifacts.get("resolved")),
        "error": _error_paragraph(error) if error else None,
    }
    return result, error


def _backend_summary(config: BootstrapConfig, resolved: Any) -> dict[str, Any]:
    """Whose pricing the plan used: ``bootstrap plan`` always simulates the GPU; ``trtllm`` prices
    the KV cache as TensorRT-LLM's chosen manager does."""
    return {"name": config.backend, "kv_manager": resolved.kv_manager if resolved is not None else None}


def _error_paragraph(exc: StageFailed) -> str:
    tries = "attempt" if exc.attempts == 1 else "attempts"
    text = f"bootstrap failed at stage {exc.stage!r} after {exc.attempts} {tries}: {exc.cause}"
    return f"{text}. {exc.advice}" if exc.advice else text


def plan_line(plan: dict[str, Any]) -> str:
    """The plan in words, one line per pool after the first."""
    lines = [
        f"KV budget {plan['kv_budget_bytes'] / GiB:.2f} GiB ({plan['kv_budget_bytes']} bytes, limited by "
        f"{plan['limited_by']}): {plan['kv_tokens']} tokens, room for {plan['kv_requests']} requests of "
        f"max_seq_len {plan['max_seq_len']}; {plan['max_concurrent_requests']} run at once "
        f"(max_batch_size {plan['max_batch_size']}); max_num_tokens {plan['max_num_tokens']}"
    ]
    for name, pool in plan.get("pools", {}).items():
        share = plan.get(f"{name}_share", 0.0)
        lines.append(f"  {name}: {pool['gpu_bytes'] / GiB:.2f} GiB, {pool['tokens']} tokens ({share:.1%})")
    return "\n".join(lines)


def print_plan(result: dict[str, Any], console: Console) -> None:
    console.print(stage_table(result["stages"]))
    if result["plan"]:
        console.print(plan_line(result["plan"]), highlight=False)
    backend = result.get("backend") or {}
    if backend.get("name") == "trtllm" and backend.get("kv_manager"):
        console.print(f"KV priced as TensorRT-LLM's {backend['kv_manager']} allocates it (simulated GPU)")
    console.print(f"device {result['device']['name']}: leaked bytes after teardown: {result['device']['leaked_bytes']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "cache":
        return clear_cache(args)
    if args.command == "run":
        return main_run(args)
    if args.command == "serve":
        return main_serve(args)
    if args.command == "trace":
        return trace_command(args)
    try:
        result, error = anyio.run(run_plan, args)
    except INPUT_ERRORS as exc:
        if args.json:  # the same shape as every other answer, for programs
            print(json.dumps({"stages": [], "plan": {}, "device": None, "error": str(exc)}, indent=2))
        print(f"bootstrap: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the pipeline was cancelled and rolled every stage back
        print("bootstrap: interrupted; completed stages were rolled back", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_plan(result, Console())
    if error is None:
        return 0
    print(result["error"], file=sys.stderr)
    return 2 if isinstance(error.cause, BAD_INPUT) else 1


def main_run(args: argparse.Namespace) -> int:
    """One rank's run (or the only one); ``--tp N`` without a launcher starts N ranks of it."""
    bad_input = (*BAD_INPUT, *_engine_input_errors())
    try:
        config = config_from_args(args)
        if needs_launch(config):
            return launch_ranks(args, config.tensor_parallel_size, main_run)
        result, error = anyio.run(run_command, args, config, rank_backend(config, args))
    except (*INPUT_ERRORS, *bad_input) as exc:
        if rank_of(args) == 0:
            emit({"text": "", "token_ids": [], "stages": [], "plan": {}, "error": str(exc)}, args.json)
        return 2
    except KeyboardInterrupt:
        print("bootstrap: interrupted; completed stages were rolled back", file=sys.stderr)
        return 130
    finally:
        leave()
    if rank_of(args) > 0:
        return 0 if error is None else 1
    emit(result, args.json)
    if error is None:
        return 0
    return 2 if isinstance(getattr(error, "cause", error), bad_input) else 1


def _engine_input_errors() -> tuple[type[BaseException], ...]:
    from bootstrap.engine.loader import ModelSourceError

    return (ModelSourceError,)


if __name__ == "__main__":
    sys.exit(main())
