"""The weights' dtype and quantization, and the KV cache dtype, in every summary (issue 56,
item 5): ``plan``'s and ``run``'s printed plan, and the ``plan`` object of ``--json`` (which the
server's ``/v1/bootstrap`` and the Python report share, ``stages.summary``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.fp8_checkpoints import CHANNEL

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity.presets import preset_config
from bootstrap.cli import run as run_command
from bootstrap.cli.main import main

PLAN = ["plan", "--gpu", "h200", "--max-seq-len", "8192"]
AT_LOAD = "weights: bfloat16, projections FP8 (quantized at load by --quantization fp8; a scale per output row)"


def printed(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


@pytest.fixture
def fp8_checkpoint(tmp_path) -> Path:
    """A config.json as an FP8 release declares it (compressed-tensors, per channel)."""
    (tmp_path / "config.json").write_text(json.dumps({**preset_config("llama-3.1-8b"), "quantization_config": CHANNEL}))
    return tmp_path


@pytest.mark.parametrize(
    "flags, weights, kv",
    [
        ([], "weights: bfloat16, not quantized", "KV cache dtype: bfloat16"),
        (["--quantization", "fp8", "--kv-cache-dtype", "fp8"], AT_LOAD, "KV cache dtype: fp8"),
    ],
    ids=["16-bit", "fp8"],
)
def test_plan_prints_the_weights_and_the_kv_dtype(flags, weights, kv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    lines = printed(capsys, *PLAN, "--model", "llama-3.1-8b", *flags)
    assert weights in lines and kv in lines


def test_an_fp8_checkpoint_s_weights_are_named_as_the_checkpoint_s(fp8_checkpoint, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    lines = printed(capsys, *PLAN, "--model", str(fp8_checkpoint))
    assert "weights: bfloat16, projections FP8 (the checkpoint's, compressed-tensors; a scale per output row)" in lines


def test_plan_json_carries_the_weights_and_the_kv_dtype(capsys):
    plan = json.loads("\n".join(printed(capsys, *PLAN, "--model", "llama-3.1-8b", "--quantization", "fp8", "--json")))
    assert plan["plan"]["weights"] == {"dtype": "bfloat16", "quantization": "fp8-at-load", "strategy": "channel"}
    assert plan["plan"]["kv_dtype"] == "bfloat16"


def test_run_prints_the_weights_and_the_kv_dtype_under_its_stage_table(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: SimBackend(sim_device("h200")))
    argv = ["run", "--model", "llama-3.1-8b", "--no-plan-cache", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    main(argv)  # the simulated executor takes no prompt (exit 2), after the summary
    lines = capsys.readouterr().out.splitlines()
    assert AT_LOAD in lines and "KV cache dtype: fp8" in lines
