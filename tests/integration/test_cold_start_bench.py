"""``benchmarks/cold_start.py``: where its checkpoint goes, and starts that fail counted, written and
turned into exit status 1 (real ``bootstrap run`` and ``serve`` processes on a tiny checkpoint)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from helpers.bench_runs import failed_run

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = {
    **{"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64},
    **{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    **{"max_position_embeddings": 128, "torch_dtype": "float32"},
}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checkpoint_is_named_after_the_whole_preset_or_the_config_file_s_stem(tmp_path):
    """gpu_suite.sh reads ``checkpoint-llama-3.1-8b`` (not ``checkpoint-llama-3``) and, in its
    smoke, ``checkpoint-tiny`` for ``tiny.json``."""
    checkpoint_dir = load_script("cold_start").checkpoint_dir
    assert checkpoint_dir(tmp_path, "llama-3.1-8b") == tmp_path / "checkpoint-llama-3.1-8b"
    assert checkpoint_dir(tmp_path, "qwen2.5-14b") == tmp_path / "checkpoint-qwen2.5-14b"
    assert checkpoint_dir(tmp_path, str(tmp_path / "tiny.json")) == tmp_path / "checkpoint-tiny"


def test_starts_that_fail_are_counted_written_and_exit_1(tmp_path):
    """``--max-batch-size 0``: every ``run`` and ``serve`` refuses it and exits 2. The JSON is
    written with the four starts counted as failed, stderr says so in one line, exit status 1."""
    config, out, work = tmp_path / "tiny.json", tmp_path / "cold_start.json", tmp_path / "work"
    config.write_text(json.dumps(TINY))
    argv = ["--shape", str(config), "--device", "cpu", "--repeats", "1", "--max-seq-len", "64"]
    argv += ["--max-num-tokens", "64", "--max-batch-size", "0", "--workdir", str(work)]
    reason, report = failed_run("cold_start", argv, out)
    assert reason.startswith("cold_start: 4 of 4 starts failed (exit 2 x4): "), reason
    assert "max-batch-size" in reason or "max_batch_size" in reason, reason
    assert report["failures"]["statuses"] == {"exit 2": 4} and report["failures"]["first_error"] in reason
    cold = report["repeats"][0]["cold"]
    assert cold["run"]["code"] == cold["serve"]["code"] == 2 and cold["serve"]["ready_s"] is None
    assert (work / "checkpoint-tiny" / "config.json").is_file()
