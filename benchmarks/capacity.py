"""KV capacity against the physical limit, and the worst-case load it must survive.

One process, one model, two starts through the native backend, side by side:

- ``fraction_0.9``: ``free_gpu_memory_fraction`` 0.9 given explicitly: TensorRT-LLM's rule and
  semantics (KV gets 0.9 of the memory left after the measured peak);
- ``default``: no memory rule given: on CUDA the native engine's default headroom
  (``bootstrap.backends.native.headroom``: the measured activation peak again, one continued
  prompt chunk's gathered context and mask, 512 MiB of workspaces) is kept free and KV gets the
  rest; elsewhere the default is the fraction rule;
- with ``--headroom-bytes N``, a third start with ``kv_headroom_bytes`` N.

For each start, figures read at the ready executor, idle, with torch's cached blocks returned:

- ``physical limit`` = total - (weights + executor state + CUDA graphs) - measured activation
  peak - non-torch memory: the most any KV pool could hold with nothing else running;
- the KV pool allocated, as a fraction of that limit;
- on the same measurements, what TensorRT-LLM's default would give (0.9 of the memory left after
  the peak) and vLLM's (``gpu_memory_utilization`` 0.9: 0.9 of total minus non-KV memory).

Then the worst-case load: every KV block filled by concurrent requests of ``max_seq_len`` tokens
(prompt plus output, so admission reserves whole requests), their prompt lengths staggered
(``staggered_lengths``) so that the last full ``max_num_tokens`` prefill step runs while every
other request decodes at nearly ``max_seq_len`` tokens of context. Counted honestly: requests
that ended in an error (and how many of those were out of memory), steps that raised (the
executor then reruns the requests one by one; an OOM there is counted even when the reruns
succeed), requests unfinished at the deadline, and the device's peak allocated and reserved bytes.
Errors are counted by wrapping the executor's model runner and sampler for the load's duration.

    python benchmarks/capacity.py --device cuda --model random:llama-3.1-8b --max-seq-len 8192 \
        --max-num-tokens 8192 --max-batch-size 256 --out capacity.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import emit, failure, positive_int, ratio, release_memory, report_header, resolve_device, save

from bootstrap.api import Bootstrap
from bootstrap.backends.native.loading import DTYPES
from bootstrap.config import BootstrapConfig
from bootstrap.devices import is_oom
from bootstrap.engine.sampling.sampler import SamplingParams

TAIL_STEPS = 3  # decode-only steps at full occupancy after the last prefill
GOALS = {"kv_fraction_of_physical": 0.97, "worst_case_ooms": 0, "defaults_for_comparison": 0.9}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="random:llama-3.1-8b", help="model source (random:<preset> at real shapes)")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--dtype", default="auto", choices=["auto", *DTYPES], help="weights and KV; auto: bfloat16 on CUDA")
    add("--max-seq-len", type=positive_int, default=8192)
    add("--max-num-tokens", type=positive_int, default=8192)
    add("--max-batch-size", type=positive_int, default=256, help="at least the requests the pool holds")
    add("--load-timeout-s", type=float, default=120.0, help="deadline of each worst-case load")
    add("--headroom-bytes", type=int, default=None, help="also measure a start with this kv_headroom_bytes")
    add("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


# ---- measurements ---------------------------------------------------------------------------


def idle_reading(device: torch.device) -> dict[str, int]:
    """Allocated, reserved and used bytes now, torch's cached blocks returned first."""
    release_memory(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "total": total,
            "used": total - free,
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
        }
    import psutil

    memory, rss = psutil.virtual_memory(), psutil.Process().memory_info().rss
    return {"total": memory.total, "used": memory.total - memory.available, "allocated": rss, "reserved": rss}


def physical_figures(plan: dict[str, Any], idle: dict[str, int]) -> dict[str, int]:
    """The physical limit and what it is made of, from the profile and the idle executor."""
    profile = plan["profile"]
    weights_and_state = idle["allocated"] - plan["kv_budget_bytes"]
    non_torch = max(idle["used"] - idle["reserved"], 0)
    activation = profile["activation_bytes"]
    return {
        "total_bytes": idle["total"],
        "weights_and_state_bytes": weights_and_state,
        "activation_bytes": activation,
        "non_torch_bytes": non_torch,
        "non_torch_in_profile_bytes": profile["peak_bytes"] - profile["torch_peak_bytes"],
        "physical_limit_bytes": idle["total"] - weights_and_state - activation - non_torch,
    }


def peer_rules(figures: dict[str, int], fraction: float = 0.9) -> dict[str, dict[str, Any]]:
    """What TensorRT-LLM's and vLLM's defaults would allocate on the same measurements."""
    limit, total = figures["physical_limit_bytes"], figures["total_bytes"]
    trtllm = int(limit * fraction)  # fraction of what the peak leaves
    vllm = int(total * fraction) - (total - limit)  # fraction of total, less all non-KV memory
    return {
        "trtllm_default": {"kv_bytes": trtllm, "fraction_of_physical": ratio(trtllm, limit)},
        "vllm_default": {"kv_bytes": vllm, "fraction_of_physical": ratio(vllm, limit)},
    }


# ---- the worst-case load --------------------------------------------------------------------


def simulate(prompts: list[int], outputs: list[int], max_num_tokens: int) -> tuple[list[int], list[int]]:
    """Step at which each request finishes its prefill and its last token, under the engine's
    micro-batch rule (every decode first, then prefill chunks in admission order)."""
    done_prefill, pending = [0] * len(prompts), list(prompts)
    generated, finished = [0] * len(prompts), [0] * len(prompts)
    step = 0
    while not all(finished):
        step += 1
        decoding = [i for i in range(len(prompts)) if not pending[i] and not finished[i]]
        budget = max_num_tokens - len(decoding)
        for i in decoding:
            generated[i] += 1
        for i in (i for i in range(len(prompts)) if pending[i]):
            if budget <= 0:
                break
            chunk = min(pending[i], budget)
            pending[i], budget = pending[i] - chunk, budget - chunk
            if not pending[i]:
                done_prefill[i], generated[i] = step, 1  # the step that completes a prompt samples
        for i in range(len(prompts)):
            if not finished[i] and generated[i] >= outputs[i]:
                finished[i] = step
    return done_prefill, finished


def staggered_lengths(
    requests: int, max_seq_len: int, max_num_tokens: int, tail: int = TAIL_STEPS
) -> list[tuple[int, int]]:
    """(prompt, output) per request, each summing to ``max_seq_len``, so that every request
    finishes about ``tail`` steps after the last prefill step (a few rounds of ``simulate``)."""
    outputs = [1] * requests
    for _ in range(6):
        prompts = [max_seq_len - g for g in outputs]
        done_prefill, _ = simulate(prompts, outputs, max_num_tokens)
        last = max(done_prefill)
        outputs = [min(max(last - d + tail, 1), max_seq_len - 1) for d in done_prefill]
    return [(max_seq_len - g, g) for g in outputs]


class StepErrors:
    """Counts the forward and sampler calls that raise while the load runs, and which of them ran
    out of memory. The executor reruns a failed step of several requests one request at a time,
    so a step that fails is counted, and so is every rerun that fails again."""

    def __init__(self) -> None:
        self.failed = self.oom = 0
        self.messages: list[str] = []

    def wrap(self, call: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except Exception as exc:
                self.failed, self.oom = self.failed + 1, self.oom + is_oom(exc)
                if len(self.messages) < 5:
                    self.messages.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                raise

        return counted


@contextmanager
def counting_step_errors(executor: Any) -> Iterator[StepErrors]:
    """The executor's model runner and sampler, their calls counted (instance attributes shadow
    the methods while the load runs; nothing else changes)."""
    errors = StepErrors()
    executor.runner.run = errors.wrap(executor.runner.run)
    executor.sampler.sample = errors.wrap(executor.sampler.sample)
    try:
        yield errors
    finally:
        del executor.runner.run, executor.sampler.sample


def worst_case_load(executor: Any, plan: dict[str, Any], device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Fill every block with staggered ``max_seq_len`` requests; run them all; count errors."""
    lengths = workload(plan)
    with counting_step_errors(executor) as errors:
        started = time.perf_counter()
        responses, unfinished = collect(executor, start_load(executor, lengths, device), started + timeout_s)
    return load_report(lengths, (responses, unfinished), errors, plan, device, time.perf_counter() - started)


def workload(plan: dict[str, Any]) -> list[tuple[int, int]]:
    """Staggered full-length requests, as many as run at once, and one more for the blocks left."""
    tpb, blocks = plan["tokens_per_block"], plan["kv_blocks"]
    per_request = -(-plan["max_seq_len"] // tpb)
    count = min(blocks // per_request, plan["max_batch_size"])
    lengths = staggered_lengths(count, plan["max_seq_len"], plan["max_num_tokens"])
    rest = (blocks - count * per_request) * tpb
    if count < plan["max_batch_size"] and rest >= 2:
        output = min(lengths[-1][1] if lengths else 1, rest - 1)
        lengths.append((rest - output, output))
    return lengths


def start_load(executor: Any, lengths: list[tuple[int, int]], device: torch.device) -> list[int]:
    vocab = executor.runner.vocab_size
    generator = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ids = []
    for prompt, output in lengths:
        tokens = torch.randint(0, vocab, (prompt,), generator=generator).tolist()
        ids.append(executor.enqueue(tokens, SamplingParams(max_tokens=output, ignore_eos=True)))
    return ids


def collect(executor: Any, requests: list[int], deadline: float) -> tuple[list[Any], int]:
    """Every response there is by the deadline, and how many requests had none: a wait that
    times out cancels its request (``cancel_on_abandon``), which frees its blocks at once."""
    responses, unfinished = [], 0
    for rid in requests:
        try:
            responses.append(
                executor.await_response(rid, max(deadline - time.perf_counter(), 0.001), cancel_on_abandon=True)
            )
        except (TimeoutError, KeyError):  # KeyError: released unclaimed (more than max_unclaimed finished first)
            unfinished += 1
    return responses, unfinished


def load_report(
    lengths: list[tuple[int, int]],
    answered: tuple[list[Any], int],
    errors: StepErrors,
    plan: dict[str, Any],
    device: torch.device,
    seconds: float,
) -> dict[str, Any]:
    responses, unfinished = answered
    errored = [r for r in responses if r.finish_reason == "error"]
    tokens = sum(p + o for p, o in lengths)
    report = {
        "requests": len(lengths),
        "kv_tokens_filled": tokens,
        "kv_fill_fraction": ratio(tokens, plan["kv_tokens"]),
        "completed": sum(r.finish_reason in ("length", "stop") for r in responses),
        "unfinished_at_deadline": unfinished,
        "requests_errored": len(errored),
        "requests_errored_oom": sum("out of memory" in (r.error or "").lower() for r in errored),
        "steps_failed": errors.failed,
        "steps_failed_oom": errors.oom,
        "error_samples": errors.messages + [r.error for r in errored[:2]],
        "seconds": round(seconds, 2),
    }
    if device.type == "cuda":
        report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        report["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return report


# ---- one start ------------------------------------------------------------------------------


def make_config(args: argparse.Namespace, **rule: Any) -> BootstrapConfig:
    """The benchmark's shape under a memory ``rule`` (none: the backend's default)."""
    return BootstrapConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=args.max_batch_size,
        **rule,
    )


async def one_start(label: str, config: BootstrapConfig, device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Build, read the idle figures, run the worst-case load, release."""
    release_memory(device)
    boot = Bootstrap(config)
    try:
        executor = await boot.build()
        plan = boot.report().plan
        figures = physical_figures(plan, idle_reading(device))
        load = worst_case_load(executor, plan, device, timeout_s)
        load.update(headroom_use(load, figures, plan))
        print(f"capacity {label}: {load}", file=sys.stderr, flush=True)
    finally:
        await boot.aclose()
    del boot
    release_memory(device)
    return {
        "label": label,
        "config": config_record(config),
        "plan": plan_record(plan),
        "figures": figures,
        "kv_fraction_of_physical": ratio(plan["kv_budget_bytes"], figures["physical_limit_bytes"]),
        "load": load,
    }


def headroom_use(load: dict[str, Any], figures: dict[str, int], plan: dict[str, Any]) -> dict[str, Any]:
    """How much of the memory beside the weights and the pool the load took at its peak."""
    if "peak_reserved_bytes" not in load:
        return {}
    resident = figures["weights_and_state_bytes"] + plan["kv_budget_bytes"]
    room = figures["total_bytes"] - figures["non_torch_bytes"] - resident
    transient = load["peak_reserved_bytes"] - resident
    return {
        "transient_peak_bytes": transient,
        "room_beside_pool_bytes": room,
        "room_used_fraction": ratio(transient, room),
    }


def config_record(config: BootstrapConfig) -> dict[str, Any]:
    keys = (
        "model",
        "dtype",
        "max_seq_len",
        "max_num_tokens",
        "max_batch_size",
        "free_gpu_memory_fraction",
        "kv_headroom_bytes",
    )
    return {k: getattr(config, k) for k in keys}


def plan_record(plan: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "kv_budget_bytes",
        "planned_kv_budget_bytes",
        "kv_tokens",
        "kv_blocks",
        "kv_requests",
        "limited_by",
        "headroom_bytes",
        "fraction",
        "profile",
    )
    return {k: plan.get(k) for k in keys}


# ---- the run --------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    """TensorRT-LLM's rule, then the default (and ``--headroom-bytes``), into ``report``, saved
    after each start."""
    starts = [("fraction_0.9", {"free_gpu_memory_fraction": 0.9}), ("default", {})]
    if args.headroom_bytes is not None:
        starts.append(("headroom", {"kv_headroom_bytes": args.headroom_bytes}))
    for label, rule in starts:
        report["starts"].append(await guarded(label, make_config(args, **rule), device, args))
        save(report, args.out)
    measured = next((s for s in report["starts"] if "error" not in s), None)
    if measured is not None:
        report["peers"] = peer_rules(measured["figures"])
        report["summary"] = summary(report["starts"], report["peers"])


async def guarded(
    label: str, config: BootstrapConfig, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """``one_start``, or its error: a start that fails is a result too."""
    try:
        return await one_start(label, config, device, args.load_timeout_s)
    except Exception as exc:
        release_memory(device)
        print(f"capacity {label}: {exc}", file=sys.stderr, flush=True)
        return {"label": label, "config": config_record(config), **failure(exc)}


def summary(starts: list[dict[str, Any]], peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures benchmarks/README.md shows: KV as a fraction of the physical limit, OOMs under load."""
    out: dict[str, Any] = {
        name: {"kv_fraction_of_physical": rule["fraction_of_physical"]} for name, rule in peers.items()
    }
    for start in starts:
        if "error" in start:
            out[start["label"]] = {"error": start["error"]}
            continue
        load = start["load"]
        out[start["label"]] = {
            "kv_fraction_of_physical": start["kv_fraction_of_physical"],
            "kv_bytes": start["plan"]["kv_budget_bytes"],
            "worst_case_requests_errored": load["requests_errored"],
            "worst_case_steps_failed_oom": load["steps_failed_oom"],
            "worst_case_unfinished": load["unfinished_at_deadline"],
            "worst_case_kv_fill": load["kv_fill_fraction"],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = {
        **report_header("capacity", argv, device),
        "goals": GOALS,
        "starts": [],
    }
    anyio.run(measure, args, device, report)
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
