"""A CUDA start's hot path (Triton kernels, CUDA graphs captured at warmup) imports no sympy,
dynamo, inductor or transformers either: ``helpers.start_imports`` on a fresh ``bootstrap run``."""

from __future__ import annotations

import pytest
import torch
from helpers.start_imports import DENIED, denied, imported, run_log
from helpers.tiny_models import save_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_cuda_run_imports_none_of_the_denied_modules(tmp_path):
    modules = imported(run_log(save_checkpoint("llama", tmp_path / "llama"), "cuda"))
    assert {"torch", "bootstrap.engine.layers.gathered", "bootstrap.engine.step.graphs"} <= modules
    assert denied(modules) == [], f"the start imported {denied(modules)[:5]} (denied: {DENIED})"
