"""``bootstrap plan``: every stage on a simulated GPU, a dry-run capacity planner (no torch).

``--fault STAGE:oom[:N]`` makes the first N attempts of a stage run out of (simulated) memory,
to see its retries and adaptations.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console

from bootstrap.api import make_pipeline
from bootstrap.cli.args import add_config_args, config_from_args
from bootstrap.cli.exits import BAD_INPUT, BAD_INPUT_ERRORS, INTERRUPTED, exit_status
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import GiB
from bootstrap.pipeline import StageFailed, failure_paragraph
from bootstrap.pipeline.report import retry_lines, stage_rows, stage_table
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages import STAGE_IDS
from bootstrap.stages.summary import plan_summary

MAX_FAULT_DIGITS = 9
FAULTABLE = ("load_model", "estimation_build", "profiling", "final_build", "scheduler_sampler")


def add_plan_args(plan: argparse.ArgumentParser) -> None:
    from bootstrap.backends.sim.gpus import SIM_GPUS

    add_config_args(plan, "plan")
    add = plan.add_argument
    add("--gpu", required=True, help=f"a simulated GPU: {', '.join(SIM_GPUS)}, or a size such as 80GiB")
    add("--trace-file", type=Path, help="write finished spans as JSON Lines, overwriting the file (default: none)")
    add("--otlp", action="store_true", help="also export spans over OTLP (needs the otlp extra)")
    add("--json", action="store_true", help="print one JSON object instead of tables")
    add(
        "--fault",
        action="append",
        default=[],
        metavar="STAGE:oom[:N]",
        help=f"make the first N attempts of STAGE raise a simulated OOM (repeatable; {', '.join(FAULTABLE)})",
    )


def parse_fault(text: str) -> tuple[str, int]:
    """``STAGE:oom[:N]`` to (stage, N); errors name the allowed stages."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[1] != "oom":
        raise ConfigError(f"--fault {text!r}: expected STAGE:oom or STAGE:oom:N")
    if parts[0] not in FAULTABLE:
        kind = "allocates no device memory" if parts[0] in STAGE_IDS else "is not a stage"
        raise ConfigError(f"--fault {text!r}: {parts[0]!r} {kind}; allowed stages: {', '.join(FAULTABLE)}")
    count = parts[2] if len(parts) == 3 else "1"
    if not (count.isascii() and count.isdigit()) or len(count) > MAX_FAULT_DIGITS or int(count) < 1:
        # isdigit alone takes '²' (int() refuses it) and 5000 digits (past int()'s limit)
        raise ConfigError(f"--fault {text!r}: N must be an integer in [1, {10**MAX_FAULT_DIGITS - 1}], got {count!r}")
    return parts[0], int(count)


def main_plan(args: argparse.Namespace) -> int:
    try:
        result, error = anyio.run(run_plan, args)
    except BAD_INPUT_ERRORS as exc:
        if args.json:  # the same shape as every other answer, for programs
            print(json.dumps({"stages": [], "plan": {}, "device": None, "error": str(exc)}, indent=2))
        print(f"bootstrap: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:  # the pipeline was cancelled and rolled every stage back
        print("bootstrap: interrupted; completed stages were rolled back", file=sys.stderr)
        return INTERRUPTED
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_plan(result, Console())
    if error is not None:
        print(result["error"], file=sys.stderr)
    return exit_status(error)


async def run_plan(args: argparse.Namespace) -> tuple[dict[str, Any], StageFailed | None]:
    from bootstrap.backends.sim.backend import SimBackend
    from bootstrap.backends.sim.gpus import sim_device

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
            summary = plan_summary(pipeline.artifacts)  # prefix_caching too: it reserves nothing, the plan is the same
            await pipeline.aclose()  # also after Ctrl-C: no device thread or bytes left behind
    finally:
        provider.shutdown()
    result = {
        "stages": stage_rows(memory.get_finished_spans()),
        "plan": summary,
        "device": {"name": device.name, "total_bytes": device.total, "leaked_bytes": sum(device.live().values())},
        "backend": _backend_summary(config, pipeline.artifacts.get("resolved")),
        "error": failure_paragraph(error) if error else None,
    }
    return result, error


def _backend_summary(config: BootstrapConfig, resolved: Any) -> dict[str, Any]:
    """Whose pricing the plan used: ``bootstrap plan`` always simulates the GPU; ``trtllm`` prices
    the KV cache as TensorRT-LLM's chosen manager does."""
    return {"name": config.backend, "kv_manager": resolved.kv_manager if resolved is not None else None}


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
    if "weights" in plan:
        lines.append(weights_line(plan["weights"]))
    if "kv_dtype" in plan:
        scales = f", scales {plan['kv_scales']}" if "kv_scales" in plan else ""
        lines.append(f"KV cache dtype: {plan['kv_dtype']}{scales}")
    if "prefix_caching" in plan:
        lines.append(PREFIX_CACHING[plan["prefix_caching"]])
    return "\n".join(lines)


def print_retries(rows: list[dict[str, Any]], console: Console) -> None:
    """Under the stage table: each retried attempt's error and what its retry changed, verbatim."""
    for line in retry_lines(rows, console.width):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def print_wrapped(text: str, console: Console) -> None:
    """Each line of ``text`` wrapped between words at the console's width (no trailing space; a
    word longer than a line stays whole), its continuation indented four more."""
    for line in text.splitlines():
        lead = " " * (len(line) - len(line.lstrip()) + 4)
        for part in textwrap.wrap(line, max(console.width, 20), subsequent_indent=lead, break_long_words=False):
            console.print(part, markup=False, highlight=False, soft_wrap=True)


SCALES = {"channel": "a scale per output row", "tensor": "a scale per matrix", "block": "a scale per block"}


def weights_line(weights: dict[str, Any]) -> str:
    """The weights' dtype and quantization in words (``stages.summary.weights_summary``)."""
    method, strategy = weights.get("quantization"), weights.get("strategy")
    if method is None:
        return f"weights: {weights['dtype']}, not quantized"
    if strategy is None:  # a method the engine does not run as FP8: priced at 16 bits
        return f"weights: {weights['dtype']}, checkpoint quantization {method} (priced at 16 bits)"
    source = "quantized at load by --quantization fp8" if method == "fp8-at-load" else f"the checkpoint's, {method}"
    return f"weights: {weights['dtype']}, projections FP8 ({source}; {SCALES.get(strategy, strategy)})"


PREFIX_CACHING = {  # the cache changes no figure above: cached blocks nobody holds are free capacity
    True: "prefix caching: on (a prompt prefix computed before reuses its KV blocks)",
    False: "prefix caching: off (--no-prefix-cache)",
}


def print_plan(result: dict[str, Any], console: Console) -> None:
    console.print(stage_table(result["stages"]))
    print_retries(result["stages"], console)
    if result["plan"]:
        print_wrapped(plan_line(result["plan"]), console)
    backend = result.get("backend") or {}
    if backend.get("name") == "trtllm" and backend.get("kv_manager"):
        console.print(f"KV priced as TensorRT-LLM's {backend['kv_manager']} allocates it (simulated GPU)")
    console.print(f"device {result['device']['name']}: leaked bytes after teardown: {result['device']['leaked_bytes']}")
