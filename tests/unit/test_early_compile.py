"""``backends.native.early_compile.begin_for``: what the backend asks to compile before any stage,
for which configs (one CUDA device, the native engine, a checkpoint or ``random:`` source the own
code runs), in the dtype ``resolve_classes`` will pick; the builder it hands over builds the
load's shapes on the meta device. ``compile_ahead.begin_early`` (CUDA only) is recorded, not run."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import save_checkpoint

from bootstrap.backends.native import early_compile
from bootstrap.config import BootstrapConfig

CUDA = torch.device("cuda", 0)


@pytest.fixture
def begun(monkeypatch):
    calls = []
    monkeypatch.setattr(early_compile, "begin_early", lambda build, device, dtype: calls.append((build, dtype)) or True)
    return calls


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint("llama", tmp_path_factory.mktemp("early") / "llama")  # float32 weights


@pytest.mark.parametrize(("asked", "picked"), [("auto", torch.bfloat16), ("float16", torch.float16)])
def test_a_checkpoint_s_kernels_are_asked_for_in_the_dtype_the_load_takes(begun, llama, asked, picked):
    assert early_compile.begin_for(BootstrapConfig(model=str(llama), dtype=asked), CUDA)
    [(build, dtype)] = begun
    model = build()
    assert dtype == picked and next(model.parameters()).device.type == "meta"
    assert next(model.parameters()).dtype == picked and sum(p.numel() for p in model.parameters()) > 0


def test_a_random_preset_and_fp8_at_load_are_asked_for_as_the_load_builds_them(begun):
    assert early_compile.begin_for(BootstrapConfig(model="random:llama-3.2-1b", quantization="fp8"), CUDA)
    [(build, dtype)] = begun
    weights = {p.dtype for p in build().parameters()}
    assert dtype == torch.bfloat16 and torch.float8_e4m3fn in weights  # the projections quantized at load


@pytest.mark.parametrize(
    ("config", "device"),
    [
        ({"model": "random:llama-3.2-1b"}, torch.device("cpu")),
        ({"model": "random:llama-3.2-1b", "backend": "trtllm"}, CUDA),
        ({"model": "random:llama-3.2-1b", "tensor_parallel_size": 2}, CUDA),  # each rank its own shard
        ({"model": "/no/such/checkpoint"}, CUDA),  # resolve_classes names what is wrong
    ],
)
def test_nothing_is_asked_for_off_one_cuda_device_or_a_source_it_cannot_read(begun, config, device):
    assert not early_compile.begin_for(BootstrapConfig(**config), device)
    assert begun == []
