"""Where a model's parameters live (``bootstrap.engine.models.residency``), on the CPU: offload to
one host buffer and restore, drop and reallocate then read the checkpoint again; each leaves the
same parameter objects, the tie, and logits equal to the original's exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import last_logits, save_checkpoint

from bootstrap.engine.models import load_own_model
from bootstrap.engine.models.reload import reload_weights
from bootstrap.engine.models.residency import drop, offload, reallocate
from bootstrap.engine.models.weights import plan_weights, safetensors_files

CPU = torch.device("cpu")
IDS = [1, 5, 17, 42, 99, 3, 250]


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """Gemma 2's head is tied to its embeddings."""
    return save_checkpoint("gemma2", tmp_path_factory.mktemp("ckpt") / "gemma2")


@pytest.fixture
def model(tied) -> torch.nn.Module:
    model = load_own_model(tied, CPU, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def identities(model: torch.nn.Module) -> dict[str, int]:
    return {name: id(param) for name, param in model.named_parameters(remove_duplicate=False)}


def test_offload_moves_every_parameter_into_one_buffer_and_restore_brings_them_back(model):
    expected, params = last_logits(model, IDS), identities(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    copy = offload(model, pin=True)  # on the CPU nothing is page-locked

    assert not copy.pinned and copy.nbytes == weight_bytes(model)
    buffer = copy.flat.untyped_storage().data_ptr()
    assert all(param.untyped_storage().data_ptr() == buffer for param in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight

    assert copy.restore() == weight_bytes(model)
    assert all(param.untyped_storage().data_ptr() != buffer for param in model.parameters())
    assert identities(model) == params and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert torch.equal(last_logits(model, IDS), expected)
    with pytest.raises(ValueError, match="back on the device already"):
        copy.restore()


def test_a_later_offload_takes_the_same_buffer_again(model):
    expected = last_logits(model, IDS)
    first = offload(model, pin=False)
    with pytest.raises(ValueError, match="never restored"):
        offload(model, pin=False, reuse=first)
    first.restore()
    second = offload(model, pin=False, reuse=first)
    assert second.flat.data_ptr() == first.flat.data_ptr()
    second.restore()
    assert torch.equal(last_logits(model, IDS), expected)


def test_drop_then_reallocate_and_reload_gives_the_same_logits(model, tied):
    expected, params = last_logits(model, IDS), identities(model)
    assert drop(model) == weight_bytes(model)
    assert all(param.is_meta for param in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="meta"):
        plan_weights(model, safetensors_files(tied))
    with pytest.raises(ValueError, match="dropped"):
        offload(model, pin=False)

    assert reallocate(model, CPU) == weight_bytes(model)
    assert not any(param.is_meta for param in model.parameters())
    assert reload_weights(model, tied) > 0
    assert identities(model) == params and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(last_logits(model, IDS), expected)


class TwoViews(torch.nn.Module):
    """Two parameters viewing one storage (a tie that is not one parameter object)."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.arange(12, dtype=torch.float32)
        self.a = torch.nn.Parameter(base[:4].view(2, 2), requires_grad=False)
        self.b = torch.nn.Parameter(base[4:].view(4, 2).t(), requires_grad=False)  # offset 4, not contiguous


def test_parameters_sharing_a_storage_keep_sharing_it():
    module = TwoViews()
    a, b = module.a.clone(), module.b.clone()
    copy = offload(module, pin=False)
    assert copy.nbytes == 12 * 4  # the storage once
    copy.restore()
    assert torch.equal(module.a, a) and torch.equal(module.b, b)
    assert module.a.untyped_storage().data_ptr() == module.b.untyped_storage().data_ptr()
    assert (module.b.storage_offset(), module.b.stride()) == (4, (1, 2))
    with pytest.raises(ValueError, match="a, b share one storage"):
        drop(module)
