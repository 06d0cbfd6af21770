"""Tensor parallelism on the CPU: two real ranks (spawned processes) over gloo, a tiny Llama.

Each test launches the ranks with ``bootstrap.parallel.launch`` (as ``bootstrap run --tp 2``
does); every rank builds the executor through the eight stages (``tp_ranks``) and writes what it
got. Faults are injected per rank by a hook the rank installs on itself (``tp_ranks.HOOKS``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.fp8_checkpoints import quantized, with_kv_scales
from helpers.tiny_models import save_checkpoint
from helpers.tp_ranks import PROMPT_IDS, build_and_generate
from transformers import AutoModelForCausalLM, AutoTokenizer

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor, load_model
from bootstrap.parallel.launch import launch
from bootstrap.stages import STAGE_IDS

PROMPT = "w5 w17 w33 w9 w100 w42 w7"
TIMEOUT_S = 20.0  # every collective's; a dead rank is reported within it
CONFIG = {"tensor_parallel_size": 2, "max_seq_len": 64, "max_batch_size": 4, "max_num_tokens": 128}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("tp") / "llama")


def run_ranks(
    model: Path, out: Path, hook: str | None = None, timeout_s: float = TIMEOUT_S, **config
) -> tuple[list[int | None], list[dict]]:
    """Each rank's exit status (None: stopped by the launcher after another rank failed) and result."""
    args = (str(model), str(out), hook, timeout_s, {**CONFIG, **config})
    launched = launch(build_and_generate, args, 2)
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None for r in range(2)]
    return [launched.codes.get(r) for r in range(2)], results


def spans(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"trace{rank}.jsonl").read_text().splitlines()]


def stage_span(out: Path, rank: int, stage: str) -> dict:
    return next(s for s in spans(out, rank) if s["name"] == f"bootstrap.stage.{stage}")


def greedy_reference(path: Path, max_tokens: int, ids: list[int] = PROMPT_IDS) -> list[int]:
    """transformers' greedy ``generate()`` on one device, unsharded."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(ids) :].tolist()


def one_rank_tokens(model: torch.nn.Module, kv_scales=None) -> list[int]:
    """The engine's greedy tokens for ``PROMPT_IDS`` on one rank, on the CPU: a float32 pool, or
    with ``kv_scales`` (a loaded model's ``KVScales``) an e4m3 pool with them."""
    kv_dtype = torch.float32 if kv_scales is None else torch.float8_e4m3fn
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, kv_dtype), 256, 4, "cpu")
    if kv_scales is not None:
        cache.take_scales(kv_scales.keys, kv_scales.values)
    ex = create_executor(model, cache, SchedulerConfig(4, 128, 64), start=False)
    try:
        [single] = ex.generate([PROMPT_IDS], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        ex.shutdown()
    return list(single.token_ids)


def test_two_ranks_generate_the_greedy_tokens_of_one(llama, tmp_path):
    codes, results = run_ranks(llama, tmp_path)
    assert codes == [0, 0], [r and r["error"] for r in results]
    assert results[0]["tokens"] == results[1]["tokens"] == greedy_reference(llama, 8)
    for result in results:
        assert [s["id"] for s in result["stages"]] == list(STAGE_IDS)
        assert {s["outcome"] for s in result["stages"] if s["id"] != "warmup"} == {"ok"}  # no graphs on the CPU
        assert result["plan"]["cost"]["slope"] == 2 * 2 * 1 * 16 * 4  # 2 layers, K and V, 2 KV heads / 2 ranks, fp32
    events = [e for e in stage_span(tmp_path, 0, "profiling")["events"] if e["name"] == "bootstrap.collective.attempt"]
    assert events and events[0]["attributes"]["bootstrap.collective.world_size"] == 2


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])  # q/k/v bias and a hybrid window; tied, soft-caps, 4 norms
def test_two_ranks_of_the_own_model_code_generate_the_tokens_of_one(family, tmp_path):
    """Each rank loads its half of the heads and of the MLP into the engine's own column- and
    row-parallel layers; the two ranks' greedy tokens equal one rank's, and transformers'."""
    path = save_checkpoint(family, tmp_path / family)
    codes, results = run_ranks(path, tmp_path)
    assert codes == [0, 0], [r and r["error"] for r in results]
    one = load_model(str(path), device=torch.device("cpu"))
    heads, kv_heads, head_dim = (
        getattr(one.model.config, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    for result in results:
        assert result["model"] == {"class": "DecoderLM", "qkv_rows": (heads + 2 * kv_heads) * head_dim // 2}
    assert results[0]["tokens"] == results[1]["tokens"] == one_rank_tokens(one.model) == greedy_reference(path, 8)


def test_ranks_agree_on_the_most_conservative_profile_and_the_smallest_budget(llama, tmp_path):
    """Rank 1 measures a 1 GiB larger peak and has half rank 0's KV cap: both end with rank 1's."""
    codes, (rank0, rank1) = run_ranks(llama, tmp_path, "skewed")
    assert codes == [0, 0], (rank0["error"], rank1["error"])
    assert rank0["plan"] == rank1["plan"]
    assert rank0["plan"]["profile"]["torch_peak_bytes"] == max(
        r["plan"]["profile"]["torch_peak_bytes"] for r in (rank0, rank1)
    )
    profiling, capacity = stage_span(tmp_path, 0, "profiling"), stage_span(tmp_path, 0, "capacity")
    agreed = {
        k: v
        for e in profiling["events"] + capacity["events"]
        if e["name"] == "bootstrap.collective.attempt"
        for k, v in e["attributes"].items()
    }
    assert agreed["bootstrap.memory.torch_peak_bytes.local"] < rank0["plan"]["profile"]["torch_peak_bytes"]
    assert agreed["bootstrap.kv.budget_bytes.local"] == 2 * rank0["plan"]["planned_kv_budget_bytes"]
    assert capacity["attributes"]["bootstrap.kv.budget_bytes"] == rank0["plan"]["planned_kv_budget_bytes"]


def test_an_oom_on_rank_1_in_profiling_is_retried_on_both_ranks_the_same_way(llama, tmp_path):
    """Rank 1 alone runs out of memory; both ranks fail the attempt, roll back, make the same
    adaptation (a probe shrunk to the dummy workload, shrink.py) and succeed on the second."""
    codes, results = run_ranks(llama, tmp_path, "oom_after_first_forward")
    assert codes == [0, 0], [r["error"] for r in results]
    assert results[0]["tokens"] == results[1]["tokens"] == greedy_reference(llama, 8)
    adaptations = []
    for rank, result in enumerate(results):
        profiling = next(s for s in result["stages"] if s["id"] == "profiling")
        assert (profiling["outcome"], profiling["attempts"]) == ("ok", 2)
        attempts = [s for s in spans(tmp_path, rank) if s["name"] == "bootstrap.stage.profiling.attempt"]
        assert [a["attributes"]["bootstrap.outcome"] for a in attempts] == ["failed", "ok"]
        error = attempts[0]["events"][0]["attributes"]["exception.message"]
        assert (
            error.startswith("rank 1 failed: ProbeOutOfMemory: CUDA out of memory") and "(rank 1, 128 tokens)" in error
        )
        adaptations.append({k: v for k, v in attempts[1]["attributes"].items() if k.startswith("bootstrap.adapt.")})
        failed = [
            e
            for e in stage_span(tmp_path, rank, "profiling")["events"]
            if e["attributes"].get("bootstrap.collective.outcome") == "failed"
        ]
        assert [e["attributes"]["bootstrap.collective.failed_rank"] for e in failed] == [1]
    assert adaptations[0] == adaptations[1] and "bootstrap.adapt.probe_tokens" in adaptations[0]
    assert results[0]["plan"] == results[1]["plan"]


def test_a_rank_that_dies_mid_bootstrap_ends_the_launch_without_waiting_for_the_timeout(llama, tmp_path):
    """torch's agent sees rank 1's exit and stops rank 0 at once, whatever rank 0 is waiting on
    (with NCCL a collective with a dead peer waits out the whole timeout)."""
    started = time.monotonic()
    codes, (_, rank1) = run_ranks(llama, tmp_path, "dies_in_profiling", timeout_s=600.0)
    assert codes[1] == 17 and codes[0] in (None, 1) and rank1 is None
    assert time.monotonic() - started < 300  # far from the 600 s collective timeout


def test_a_rank_that_hangs_is_named_by_the_other_within_the_timeout(llama, tmp_path):
    """A rank that hangs is alive to the agent: rank 0's collective times out, names it and ends
    with the failure; the agent then stops the hung rank."""
    codes, (rank0, rank1) = run_ranks(llama, tmp_path, "hangs_in_profiling", timeout_s=5.0)
    assert codes[0] == 1 and rank1 is None
    assert "stage 'profiling' failed" in rank0["error"]
    assert "rank(s) 1 stopped answering" in rank0["error"]
    profiling = next(s for s in rank0["stages"] if s["id"] == "profiling")
    assert (profiling["outcome"], profiling["attempts"]) == ("failed", 1)


def test_run_tp_2_launches_the_ranks_and_only_rank_0_prints(llama, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "run",
            "--device",
            "cpu",
            "--model",
            str(llama),
            "--tp",
            "2",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--json",
            "--max-seq-len",
            "64",
            "--max-batch-size",
            "4",
            "--max-num-tokens",
            "128",
            "--dist-timeout",
            str(TIMEOUT_S),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # one JSON object: rank 1 printed nothing
    ids = AutoTokenizer.from_pretrained(llama)(PROMPT)["input_ids"]
    assert result["error"] is None and result["token_ids"] == greedy_reference(llama, 8, ids)


def test_tensor_parallel_without_ranks_is_a_clear_config_error():
    from bootstrap.backends.native.backend import NativeBackend
    from bootstrap.config import BootstrapConfig, ConfigError

    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 needs 2 ranks.*torchrun --nproc-per-node 2"):
        NativeBackend.for_config(BootstrapConfig(device="cpu", tensor_parallel_size=2))


@pytest.mark.parametrize("layout", ["channel", "tensor", "block", "at_load"])
def test_two_ranks_of_fp8_weights_generate_the_tokens_of_one(layout, llama, tmp_path):
    """FP8 projections split over the ranks with their scales: row scales with the rows, and 16 x
    16 block scales by row blocks (fused parts) and by column blocks (row-parallel projections).
    ``at_load``: the 16-bit checkpoint quantized as each rank reads its slice, so a row-parallel
    projection's rows are scaled over each rank's columns: one rank holding those scales (as
    blocks of one row by half the columns) answers as the two do."""
    path, config = (llama, {"quantization": "fp8"}) if layout == "at_load" else (None, {})
    if path is None:
        path, _ = quantized(llama, tmp_path / layout, layout)
    codes, results = run_ranks(path, tmp_path, **config)
    assert codes == [0, 0], [r and r["error"] for r in results]
    one = load_model(str(path), device=torch.device("cpu"), quantize=config.get("quantization"))
    assert one.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    if layout == "at_load":
        scale_halves(one.model, load_model(str(path), device=torch.device("cpu")).model)
    assert results[0]["tokens"] == results[1]["tokens"] == one_rank_tokens(one.model)


def scale_halves(model: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Each row-parallel projection of ``model`` quantized from ``plain``'s 16-bit weight by
    column halves, as two ranks quantize their slices."""
    from bootstrap.engine.layers.fp8 import quantize_rows
    from bootstrap.engine.layers.linear import RowLinear

    weights = dict(plain.named_modules())
    for name, module in model.named_modules():
        if isinstance(module, RowLinear):
            halves = [quantize_rows(half) for half in weights[name].weight.detach().chunk(2, dim=1)]
            module.weight.data = torch.cat([q for q, _ in halves], dim=1)
            module.weight_scale.data = torch.cat([s for _, s in halves], dim=1)
            module.fp8_block = (1, module.weight.shape[1] // 2)


def test_two_ranks_of_an_fp8_kv_cache_with_the_checkpoints_scales_generate_the_tokens_of_one(llama, tmp_path):
    """Each rank's e4m3 pool holds its KV heads with the checkpoint's per-layer scales (1/8)."""
    eighths = with_kv_scales(llama, tmp_path / "eighths", 0.125, 2)
    codes, results = run_ranks(eighths, tmp_path, kv_cache_dtype="fp8")
    assert codes == [0, 0], [r and r["error"] for r in results]
    assert [(r["plan"]["kv_dtype"], r["plan"]["kv_scales"]) for r in results] == [("fp8", "checkpoint")] * 2
    assert [r["kv_scales"] for r in results] == [[[0.125, 0.125], [0.125, 0.125]]] * 2
    one = load_model(str(eighths), device=torch.device("cpu"))
    assert results[0]["tokens"] == results[1]["tokens"] == one_rank_tokens(one.model, one.kv_scales)


@pytest.mark.parametrize("missing", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"])
def test_a_fused_part_missing_is_refused_on_every_rank_naming_it(missing, llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(llama, path)
    tensors = load_file(path / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if n != missing}, path / "model.safetensors", metadata={"format": "pt"})
    codes, results = run_ranks(path, tmp_path)
    assert 0 not in codes and 1 in codes, codes  # a rank that did not fail first was stopped by the launcher
    errors = [r["error"] for r in results if r is not None]
    assert errors and all("load_model" in e and missing in e for e in errors), errors
