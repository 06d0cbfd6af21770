"""Weights that cannot fit are refused in ``resolve_classes``, with the figures, before
``load_model`` allocates anything (issue 20, item 4): on the CPU the alternative is the kernel's
OOM killer. ``max_kv_tokens`` below the profiling dummy is refused there too (item 10)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anyio
import psutil
import pytest
import torch

from bootstrap.api import make_pipeline
from bootstrap.backends.native import loading
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.capacity.presets import preset_shape
from bootstrap.cli.exits import BAD_INPUT, exit_status
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import FakeDevice, GiB
from bootstrap.pipeline import StageFailed

LLAMA_1B_FP32 = 4 * preset_shape("llama-3.2-1b").parameter_count()  # float32: the CPU's default dtype


def backend_with(free: int, tp: int = 1) -> NativeBackend:
    backend = NativeBackend(FakeDevice(total=free, name="small-device"), torch.device("cpu"))
    backend.tp = tp  # as a rank of tp would be
    return backend


def start(backend: NativeBackend, **fields) -> StageFailed:
    async def go() -> StageFailed:
        pipeline = make_pipeline(BootstrapConfig(**fields), backend)
        try:
            with pytest.raises(StageFailed) as info:
                await pipeline.run()
        finally:
            await pipeline.aclose()
        return info.value

    return anyio.run(go)


@pytest.fixture(autouse=True)
def no_load(monkeypatch):
    """Any allocation of weights fails the test: the refusal must come first."""

    def load(*args, **kwargs):
        raise AssertionError("load_model ran: the weights were allocated before the check")

    monkeypatch.setattr(loading, "load_model", load)


def test_weights_over_the_free_memory_are_refused_with_the_figures_before_the_load():
    failure = start(backend_with(1 * GiB), model="random:llama-3.2-1b")
    assert failure.stage == "resolve_classes" and isinstance(failure.cause, ConfigError)
    assert exit_status(failure) == BAD_INPUT
    text = str(failure.cause)
    assert f"{LLAMA_1B_FP32:,} bytes" in text and f"{GiB:,} bytes" in text  # need, available
    assert "float32" in text and "--dtype bfloat16" in text and "small-device" in text and "smaller model" in text


def test_each_rank_needs_its_share_only():
    share = LLAMA_1B_FP32 // 2
    failure = start(backend_with(share - 1, tp=2), model="random:llama-3.2-1b", tensor_parallel_size=2)
    assert f"{share:,} bytes" in str(failure.cause) and "per rank (1/2" in str(failure.cause)
    # with the share free, the check passes and the (stubbed) load is reached
    failure = start(backend_with(share + GiB, tp=2), model="random:llama-3.2-1b", tensor_parallel_size=2)
    assert failure.stage == "load_model"


def test_the_draft_weights_count_too():
    target = 4 * preset_shape("llama-3.1-8b").parameter_count()
    free = target + LLAMA_1B_FP32 // 2  # the target fits alone, not with its draft
    failure = start(backend_with(free), model="random:llama-3.1-8b", draft_model="random:llama-3.2-1b")
    assert failure.stage == "resolve_classes"
    assert f"{target + LLAMA_1B_FP32:,} bytes" in str(failure.cause) and "draft random:llama-3.2-1b" in str(
        failure.cause
    )


def test_bfloat16_halves_the_need():
    failure = start(backend_with(LLAMA_1B_FP32 // 2 + GiB), model="random:llama-3.2-1b", dtype="bfloat16")
    assert failure.stage == "load_model"  # passed the check, reached the (stubbed) load


def test_max_kv_tokens_below_the_profiling_dummy_is_refused_before_the_load():
    failure = start(backend_with(64 * GiB), model="random:smollm2-135m", max_kv_tokens=100)
    assert failure.stage == "resolve_classes" and exit_status(failure) == BAD_INPUT
    assert "max_kv_tokens: must be >= 2048 (got 100)" in str(failure.cause)


def test_cli_run_of_an_8b_model_on_this_cpu_exits_2_in_seconds_without_allocating(tmp_path):
    """``bootstrap run --model random:llama-3.1-8b --device cpu``: 32 GB of float32 weights on a
    machine with less free was SIGKILLed by the OOM killer (rc -9) once it had allocated them."""
    need = 4 * preset_shape("llama-3.1-8b").parameter_count()
    if need < psutil.virtual_memory().available:
        pytest.skip("this machine has room for 8B float32 weights")
    argv = [sys.executable, "-m", "bootstrap.cli", "run", "--model", "random:llama-3.1-8b", "--device", "cpu"]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - start < 30  # imports and config.json only: nothing was allocated
    last = done.stderr.strip().splitlines()[-1]
    assert f"need 29.92 GiB ({need:,} bytes)" in last and "available" in last and "--dtype bfloat16" in last, last
