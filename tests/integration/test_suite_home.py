"""No test touches the user's real home (``helpers.home``): the suite, and every process a test
starts, has a home of its own, and a ``bootstrap run`` with the default caches (which converts a
GGUF file and stores a plan) writes there, never under the real ``~/.cache/executor-bootstrap``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers.home import REAL_CACHE, REAL_HOME
from helpers.tiny_gguf import write_tiny_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from bootstrap.engine.sources import conversions

ROOT = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its modification time and size: any write changes it."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            stat = path.lstat()
            found[str(path.relative_to(root))] = (stat.st_mtime_ns, stat.st_size)
    return found


def test_a_run_with_the_default_caches_writes_under_the_suite_s_home_never_the_real_one(tmp_path):
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, num_key_value_heads=2, max_position_embeddings=128, **shape))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    before = snapshot(REAL_CACHE)
    argv = ["run", "--device", "cpu", "--model", str(gguf), "--prompt", "abc", "--max-tokens", "2"]
    argv += ["--max-num-tokens", "64", "--max-batch-size", "4", "--max-seq-len", "128"]
    done = subprocess.run(
        [sys.executable, "-m", "bootstrap.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )  # the environment as every test's subprocess gets it: inherited
    assert done.returncode == 0, done.stderr
    assert snapshot(REAL_CACHE) == before
    suite = Path(os.environ["HOME"]) / ".cache" / "executor-bootstrap"
    assert Path.home() != REAL_HOME and list((suite / "plans").glob("*.json")) != []
    assert conversions.find(gguf, suite) is not None
