"""A serving model's weights on a CUDA device leaving and coming back (``engine.models.residency``)
and taking new weights in place (``engine.models.reload``): the executor's greedy output the same
after each, device memory released while away, and CUDA graphs captured before a reload valid
after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.broken_checkpoints import copy_checkpoint, replace_tensors
from helpers.tiny_models import save_checkpoint

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.models import load_own_model
from bootstrap.engine.models.reload import reload_weights
from bootstrap.engine.models.residency import drop, offload, reallocate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
PROMPTS = [[1, 5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [200]]


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return save_checkpoint("gemma2", tmp_path_factory.mktemp("ckpt") / "gemma2")


def executor(model: torch.nn.Module, graphs: bool = False):
    spec = KVCacheSpec.from_config(model.config, model.dtype)
    cache = PagedKVCache.from_tokens(spec, 4096, 16, "cuda")
    ex = create_executor(model, cache, SchedulerConfig(8, 64, 256), start=False)
    if graphs:
        ex.runner.capture_decode_graphs([1, 2, 4], widths=(1, 2, 4))
    ex.start_worker()
    return ex


def greedy(ex) -> list[list[int]]:
    return [r.token_ids for r in ex.generate(PROMPTS, SamplingParams(max_tokens=8))]


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def test_offload_restore_and_drop_reload_give_the_same_output(tied):
    model = load_own_model(tied, CUDA, torch.bfloat16)
    ex = executor(model)
    expected, held = greedy(ex), torch.cuda.memory_allocated()
    copy = offload(model, pin=True)
    assert copy.pinned and copy.nbytes == weight_bytes(model)
    assert all(param.device.type == "cpu" for param in model.parameters())
    assert held - torch.cuda.memory_allocated() >= weight_bytes(model)
    assert copy.restore() == weight_bytes(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert greedy(ex) == expected

    again = offload(model, pin=True, reuse=copy)
    assert again.flat.data_ptr() == copy.flat.data_ptr()
    again.restore()
    assert greedy(ex) == expected

    held = torch.cuda.memory_allocated()
    assert drop(model) >= weight_bytes(model)
    assert held - torch.cuda.memory_allocated() >= weight_bytes(model)
    reallocate(model, CUDA)
    reload_weights(model, tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert greedy(ex) == expected
    ex.shutdown()
    again.release()


def test_graphs_captured_before_a_reload_replay_the_new_weights(tied, tmp_path):
    second = copy_checkpoint(tied, tmp_path / "second")
    generator = torch.Generator().manual_seed(5)
    replace_tensors(second, lambda ts: {k: torch.randn(v.shape, generator=generator) for k, v in ts.items()})
    fresh = executor(load_own_model(second, CUDA, torch.bfloat16), graphs=True)
    expected = greedy(fresh)
    fresh.shutdown()

    model = load_own_model(tied, CUDA, torch.bfloat16)
    ex = executor(model, graphs=True)
    before = greedy(ex)
    reload_weights(model, second)
    assert greedy(ex) == expected != before
    ex.shutdown()
