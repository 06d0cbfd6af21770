"""What each rank of the tensor-parallel tests runs (module level, so spawned ranks import it).

``build_and_generate`` builds the executor through the stages on this rank, greedy-generates a
few tokens and writes ``rank<r>.json`` (plan, profile, stages, tokens, an fp8 pool's scales, error). A ``hook`` names a
function of ``HOOKS`` that the rank installs on itself before it builds: the faults and skews
the tests inject, chosen in the test process and handed to the rank as an argument.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import anyio
import torch

from bootstrap.api import Bootstrap
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.config import BootstrapConfig
from bootstrap.devices import CpuDevice
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.engine.step.model_runner import ModelRunner
from bootstrap.parallel.torch_dist import RankEnv, init_ranks, leave_ranks
from bootstrap.pipeline import StageFailed

PROMPT_IDS = [5, 17, 33, 9, 100, 42, 7]
GiB = 1 << 30


def _oom_after_first_forward(rank: int) -> None:
    """Rank 1's first forward (the profiling dummies) completes its collectives, then raises a
    real torch OutOfMemoryError, as a failed allocation of the logits or the sampler would."""
    if rank != 1:
        return
    real_run, calls = ModelRunner.run, []

    def run(self, batch):
        logits = real_run(self, batch)
        calls.append(batch.total_tokens)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (rank 1, {batch.total_tokens} tokens)"
            )
        return logits

    ModelRunner.run = run


def _skewed(rank: int) -> None:
    """Rank 1 measures a 1 GiB higher torch peak and has half the KV cap of rank 0."""
    if rank != 1:
        return
    real_peak, real_caps = CpuDevice.peak_bytes, NativeBackend.kv_caps
    CpuDevice.peak_bytes = lambda self: real_peak(self) + GiB
    NativeBackend.kv_caps = lambda self, resolved, config: {
        k: v // 2 for k, v in real_caps(self, resolved, config).items()
    }


def _dies_in_profiling(rank: int) -> None:
    """Rank 1's process ends at once, without a word, when its profiling forward starts."""
    if rank == 1:
        ModelRunner.run = lambda self, batch: os._exit(17)


def _hangs_in_profiling(rank: int) -> None:
    """Rank 1 stops answering when its profiling forward starts, and stays alive."""
    if rank == 1:
        ModelRunner.run = lambda self, batch: time.sleep(3600)


HOOKS = {
    "oom_after_first_forward": _oom_after_first_forward,
    "skewed": _skewed,
    "dies_in_profiling": _dies_in_profiling,
    "hangs_in_profiling": _hangs_in_profiling,
}


def build_and_generate(model: str, out: str, hook: str | None, timeout_s: float, config_values: dict) -> int:
    env = RankEnv.from_env()
    torch.set_num_threads(1)
    if hook:
        HOOKS[hook](env.rank)
    config = BootstrapConfig(model=model, device="cpu", **config_values)
    result = anyio.run(_build, config, env, Path(out), timeout_s)
    (Path(out) / f"rank{env.rank}.json").write_text(json.dumps(result, default=str))
    return 0 if result["error"] is None else 1


async def _build(config: BootstrapConfig, env: RankEnv, out: Path, timeout_s: float) -> dict:
    collective = init_ranks(env, "cpu", timeout_s)
    backend = NativeBackend.for_config(config, collective=collective)
    boot = Bootstrap(config, backend=backend, trace_file=out / f"trace{env.rank}.jsonl")
    try:
        executor = await boot.build()
        result = executor.generate([PROMPT_IDS], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        model = executor.runner.model
        shape = {
            "class": type(model).__name__,
            "qkv_rows": model.model.layers[0].self_attn.qkv_proj.weight.shape[0] if hasattr(model, "tp_size") else None,
        }
        pool = executor.runner.kv_cache
        scales = pool.scales.tolist() if pool.quantized else None
        report = boot.report().to_dict()
        return {**report, "tokens": list(result.token_ids), "model": shape, "kv_scales": scales, "error": None}
    except StageFailed as exc:
        return {**boot.report().to_dict(), "tokens": [], "error": str(exc)}
    finally:
        await boot.aclose()
        leave_ranks()
