"""Checkpoint directories broken in one way each, edited from a tiny one (``tiny_models``): a
safetensors header rewritten in place, tensors replaced, the weights split over two shards, a
model that rules out every token but a few (``ruling_out``)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def read_header(file: Path) -> tuple[Any, bytes]:
    """A safetensors file's header (parsed JSON) and its data section."""
    raw = file.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_header(file: Path, header: Any, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(file: Path, change: Callable[[Any], Any]) -> None:
    """``file``'s header replaced by ``change(header)`` (which may edit it in place and return
    None), its data section left as it was."""
    header, data = read_header(file)
    changed = change(header)
    write_header(file, header if changed is None else changed, data)


def replace_tensors(path: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """The checkpoint's single weights file rewritten with ``change(tensors)``."""
    file = path / WEIGHTS
    save_file(change(load_file(file)), file, metadata={"format": "pt"})


def split_in_two(path: Path) -> tuple[Path, Path]:
    """The checkpoint's single weights file split into two shards with an index naming them."""
    tensors = load_file(path / WEIGHTS)
    names = sorted(tensors)
    shards = (path / "model-00001-of-00002.safetensors", path / "model-00002-of-00002.safetensors")
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    for shard, half in zip(shards, halves):
        save_file({name: tensors[name] for name in half}, shard, metadata={"format": "pt"})
    weight_map = {name: shard.name for shard, half in zip(shards, halves) for name in half}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / WEIGHTS).unlink()
    return shards


def edit_config(path: Path, **changes: Any) -> None:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


RULED_OUT = -1e37  # a finite weight whose logits (64 of them summed) overflow a float32 to -inf


def ruling_out(path: Path, kept: tuple[int, ...]) -> None:
    """Every token but ``kept`` gets a logit of -inf, so its logprob is -inf; the kept ones share
    the rest evenly. Every layer adds nothing (``o_proj`` and ``down_proj`` zero) and every
    embedding is ones, so the final hidden state is ones whatever the prompt; ``lm_head``'s
    rows are zero for ``kept`` (logit 0) and ``RULED_OUT`` for the others. All weights are finite."""

    def change(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, tensor in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensor)
        tensors["model.embed_tokens.weight"] = torch.ones_like(tensors["model.embed_tokens.weight"])
        tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
        head = torch.full_like(tensors["lm_head.weight"], RULED_OUT)
        head[list(kept)] = 0.0
        tensors["lm_head.weight"] = head
        return tensors

    replace_tensors(path, change)
