"""``bootstrap plan --backend trtllm`` (TensorRT-LLM's pricing on the simulated GPU, no install
needed), ``--kv-manager``, the fraction-1.0 rule, and the clear error without TensorRT-LLM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bootstrap.api import default_backend
from bootstrap.cli.main import main
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.telemetry import MissingExtra


def plan_json(capsys, *args: str) -> tuple[int, dict, str]:
    code = main(["plan", "--json", *args])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_plan_backend_trtllm_prices_as_the_v1_manager(capsys):
    code, result, err = plan_json(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--backend", "trtllm")
    assert code == 0, err
    assert result["backend"] == {"name": "trtllm", "kv_manager": "KVCacheManager"}
    assert result["plan"]["cost"] == {"slope": 131072, "intercept": 0}
    assert result["device"]["leaked_bytes"] == 0


def test_sliding_windows_price_per_manager(capsys):
    gemma = ("--model", "gemma-2-9b", "--gpu", "h100-80gb", "--max-batch-size", "16", "--max-num-tokens", "2048")
    results = {}
    for name, extra in {
        "native": (),
        "v1": ("--backend", "trtllm"),
        "v2": ("--backend", "trtllm", "--kv-manager", "v2"),
    }.items():
        code, result, err = plan_json(capsys, *gemma, *extra)
        assert code == 0, err
        results[name] = result["plan"]
    layer = 2 * 8 * 256 * 2
    assert results["v1"]["cost"] == {"slope": 42 * layer, "intercept": 0}  # every layer at full length
    assert results["v2"]["cost"]["slope"] == results["native"]["cost"]["slope"] == 21 * layer
    prefill = 2048 * 21 * layer  # V2's context-phase term for the sliding layers; native leaves it out
    assert results["v2"]["cost"]["intercept"] == results["native"]["cost"]["intercept"] + prefill
    assert results["v1"]["kv_tokens"] < results["v2"]["kv_tokens"] < results["native"]["kv_tokens"]


def test_fraction_one_is_refused_under_v1_and_accepted_under_v2(capsys):
    args = ("--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--backend", "trtllm", "--free-gpu-memory-fraction", "1.0")
    code, result, err = plan_json(capsys, *args)
    assert code == 2
    assert "free_gpu_memory_fraction: 1.0 is not accepted by TensorRT-LLM's V1 KVCacheManager" in err
    assert [s["id"] for s in result["stages"]] == ["resolve_classes"]
    code, result, err = plan_json(capsys, *args, "--kv-manager", "v2")
    assert code == 0, err
    assert result["backend"]["kv_manager"] == "KVCacheManagerV2"
    code, _, _ = plan_json(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--free-gpu-memory-fraction", "1.0")
    assert code == 0  # the native backend has no such assertion


def test_kv_manager_needs_backend_trtllm(capsys):
    code, _, err = plan_json(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-manager", "v1")
    assert code == 2 and "kv_manager: 'v1' applies to backend 'trtllm' only" in err


def test_selecting_trtllm_without_tensorrt_llm_names_the_install_command():
    config = BootstrapConfig.parse(model="llama-3.1-8b", backend="trtllm", device="cpu")
    with pytest.raises(MissingExtra, match=r"pip install 'executor-bootstrap\[trtllm\]'"):
        default_backend(config)
    assert default_backend(config.model_copy(update={"backend": "native"})).name == "native"


def test_run_with_backend_trtllm_without_tensorrt_llm_is_one_line_and_exit_2(capsys):
    code = main(["run", "--backend", "trtllm", "--device", "cpu", "--model", "random:llama-3.1-8b"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'executor-bootstrap[trtllm]'" in err and "Traceback" not in err


def test_the_cli_end_to_end():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "plan",
            "--model",
            "gemma-2-9b",
            "--gpu",
            "h200",
            "--backend",
            "trtllm",
            "--max-batch-size",
            "16",
            "--max-num-tokens",
            "2048",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "KV priced as TensorRT-LLM's KVCacheManager allocates it (simulated GPU)" in done.stdout
