"""New weights for a live model (``weights.plan_weights``, ``reload.reload_weights``): a second
checkpoint of the same tiny model, other random weights, read into the parameters in place; a
mismatch refused before any byte is read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.broken_checkpoints import copy_checkpoint, edit_config, replace_tensors
from helpers.tiny_models import last_logits, save_checkpoint

from bootstrap.engine.models import load_own_model
from bootstrap.engine.models.files import ModelSourceError
from bootstrap.engine.models.reload import reload_weights
from bootstrap.engine.models.weights import plan_weights, safetensors_files

CPU = torch.device("cpu")
IDS = [1, 5, 17, 42, 99, 3, 250]


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "first")


@pytest.fixture(scope="module")
def second(first, tmp_path_factory) -> Path:
    """``first`` with other random weights of the same shapes."""
    path = copy_checkpoint(first, tmp_path_factory.mktemp("ckpt") / "second")
    generator = torch.Generator().manual_seed(7)
    replace_tensors(path, lambda tensors: {k: torch.randn(v.shape, generator=generator) for k, v in tensors.items()})
    return path


def own(path: Path) -> torch.nn.Module:
    return load_own_model(path, CPU, torch.float32)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(param, expected[name]) for name, param in model.named_parameters())


def broken(second: Path, tmp_path: Path, change) -> Path:
    path = copy_checkpoint(second, tmp_path / "broken")
    replace_tensors(path, change)
    return path


@pytest.mark.parametrize(
    "name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
)
def test_a_tensor_of_another_shape_is_refused_naming_it_and_nothing_is_read(first, second, tmp_path, name):
    path = broken(second, tmp_path, lambda tensors: {**tensors, name: tensors[name][:, :32].contiguous()})
    live = own(first)
    before = snapshot(live)
    with pytest.raises(ModelSourceError, match=re.escape(name)):
        plan_weights(live, safetensors_files(path))
    with pytest.raises(ModelSourceError, match=re.escape(name)):
        reload_weights(live, path)
    assert same(live, before)


def test_a_missing_tensor_is_refused_naming_it_and_nothing_is_read(first, second, tmp_path):
    name = "model.layers.1.post_attention_layernorm.weight"
    path = broken(second, tmp_path, lambda tensors: {k: v for k, v in tensors.items() if k != name})
    live = own(first)
    before = snapshot(live)
    with pytest.raises(ModelSourceError, match=f"no tensor for 1 parameter.*{name}"):
        reload_weights(live, path)
    assert same(live, before)


def test_a_reload_equals_a_fresh_load_at_the_same_addresses(first, second):
    live = own(first)
    addresses = {name: param.data_ptr() for name, param in live.named_parameters()}
    fresh = own(second)
    assert not torch.equal(last_logits(live, IDS), last_logits(fresh, IDS))

    assert reload_weights(live, second) == sum(param.numel() * param.element_size() for param in fresh.parameters())
    assert same(live, snapshot(fresh))
    assert {name: param.data_ptr() for name, param in live.named_parameters()} == addresses
    assert torch.equal(last_logits(live, IDS), last_logits(fresh, IDS))


def test_the_plan_counts_the_bytes_it_reads_and_reads_only_when_asked(first, second):
    live = own(first)
    before = snapshot(live)
    reads = plan_weights(live, safetensors_files(second))
    assert same(live, before)
    assert reads.nbytes == sum(param.numel() * param.element_size() for param in live.parameters())
    reads.read(threads=2, piece_bytes=4096)
    assert same(live, snapshot(own(second)))


def test_another_setting_in_config_json_is_refused_naming_it(first, second, tmp_path):
    path = copy_checkpoint(second, tmp_path / "other-theta")
    edit_config(path, rope_theta=123456.0)
    live = own(first)
    before = snapshot(live)
    with pytest.raises(ModelSourceError, match=re.escape("rope_theta 123456.0, the serving model's is 10000.0")):
        reload_weights(live, path)
    assert same(live, before)


def test_a_directory_without_weights_is_refused_in_words(first, tmp_path):
    live = own(first)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((first / "config.json").read_bytes())
    with pytest.raises(ModelSourceError, match=re.escape(f"weights: {empty} has no safetensors files")):
        reload_weights(live, empty)
    with pytest.raises(ModelSourceError, match="is not a checkpoint directory"):
        reload_weights(live, first / "config.json")
