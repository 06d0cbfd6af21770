"""A checkpoint that is broken is refused with one line naming the file and the tensor or field,
exit status 2, before any weight is read: a FIFO or a link loop among its files, a safetensors
header whose spans do not hold together, a tensor stored twice, a dtype or a fused part that
does not fit, a config field the model code cannot compute with, a tokenizer.json cut short."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.broken_checkpoints import (
    WEIGHTS,
    copy_checkpoint,
    edit_config,
    edit_header,
    read_header,
    replace_tensors,
    split_in_two,
    write_header,
)
from safetensors.torch import load_file, save_file

from bootstrap.cli.main import main
from bootstrap.engine.models import build_own_model
from bootstrap.engine.models.weights import load_weights, safetensors_files
from bootstrap.engine.sources.loader import ModelSourceError

ROOT = Path(__file__).parents[2]
NORM, K, V = "model.norm.weight", "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"


def _offsets(name: str, change):
    def edit(header: dict) -> None:
        header[name]["data_offsets"] = change(header[name]["data_offsets"])

    return lambda path: edit_header(path / WEIGHTS, edit)


def _link_loop(path: Path) -> None:
    (path / WEIGHTS).unlink()
    os.symlink(WEIGHTS, path / WEIGHTS)


SECRET = "the first 8 bytes of this file are not a header size\n"


def _linked_elsewhere(path: Path) -> None:
    """The weights' name a link to another file, whose first 8 bytes would read as a length."""
    (path / WEIGHTS).unlink()
    (path / "notes.txt").write_text(SECRET)
    os.symlink("notes.txt", path / WEIGHTS)


def _stored_twice(path: Path) -> None:
    second = split_in_two(path)[1]
    tensors = load_file(second) | {"model.embed_tokens.weight": torch.zeros(256, 64)}  # the zeros copy
    save_file(tensors, second, metadata={"format": "pt"})


def _shared_bytes(path: Path) -> None:
    def edit(header: dict) -> None:
        header[K]["data_offsets"] = header[V]["data_offsets"]

    edit_header(path / WEIGHTS, edit)


def _dtype(name: str, dtype: str):
    def edit(header: dict) -> None:
        header[name]["dtype"] = dtype

    return lambda path: edit_header(path / WEIGHTS, edit)


def _without(name: str, field: str):
    def edit(header: dict) -> None:
        del header[name][field]

    return lambda path: edit_header(path / WEIGHTS, edit)


def _header_list(path: Path) -> None:
    header, data = read_header(path / WEIGHTS)
    write_header(path / WEIGHTS, list(header.items()), data)


def _index_weight_map_list(path: Path) -> None:
    split_in_two(path)
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": list(json.loads(index.read_text())["weight_map"].items())}))


def _columns(name: str, shape: tuple[int, int]):
    return lambda path: replace_tensors(path, lambda t: t | {name: torch.ones(shape)})


def _config(**changes):
    return lambda path: edit_config(path, **changes)


def _tokenizer_cut_short(path: Path) -> None:
    file = path / "tokenizer.json"
    file.write_bytes(file.read_bytes()[:100])


# case: (how the checkpoint is broken, what the one line names)
BROKEN = {
    "a link loop for the weights": (_link_loop, f"{WEIGHTS}: a symbolic link loop, not a regular file"),
    "weights linked to another file": (
        _linked_elsewhere,
        f"{WEIGHTS} cannot be read: not a safetensors file (a file of {len(SECRET)} bytes)",
    ),
    "a tensor in two shards": (_stored_twice, "'model.embed_tokens.weight' is stored twice"),
    "two tensors sharing bytes": (_shared_bytes, f"tensors '{K}' and '{V}' share bytes"),
    "offsets into the header": (_offsets(NORM, lambda o: [-256, 0]), f"'{NORM}' of shape [64] F32 (256 bytes)"),
    "a span shorter than shape x dtype": (
        _offsets(NORM, lambda o: [o[0], o[1] - 4]),
        f"'{NORM}' of shape [64] F32 (256 bytes): field 'data_offsets'",
    ),
    "F32 bytes labelled I32": (_dtype(NORM, "I32"), f"'{NORM}' is stored as I32"),
    "an unknown dtype": (_dtype(NORM, "F31"), f"'{NORM}': field 'dtype' must be one of"),
    "q_proj with a wrong column count": (
        _columns("model.layers.0.self_attn.q_proj.weight", (64, 63)),
        "'model.layers.0.self_attn.q_proj.weight': q_proj.weight: checkpoint shape (64, 63) does not fit",
    ),
    "gate_proj with a wrong column count": (
        _columns("model.layers.1.mlp.gate_proj.weight", (128, 65)),
        "'model.layers.1.mlp.gate_proj.weight': gate_proj.weight: checkpoint shape (128, 65) does not fit",
    ),
    "a header entry without data_offsets": (_without(NORM, "data_offsets"), f"'{NORM}': field 'data_offsets'"),
    "a header that is a list": (_header_list, f"{WEIGHTS}: the header must be a JSON object, got list"),
    "an index whose weight_map is a list": (
        _index_weight_map_list,
        "model.safetensors.index.json: field 'weight_map' must be an object",
    ),
    "a linear rope factor of 0": (
        _config(rope_scaling={"rope_type": "linear", "factor": 0}),
        "config.json: field 'rope_scaling.factor' must be a finite number > 0, got 0",
    ),
    "llama3 rope without low_freq_factor": (
        _config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
        "config.json: field 'rope_scaling.low_freq_factor' is required for rope_type 'llama3'",
    ),
    "rms_norm_eps that is no number": (
        _config(rms_norm_eps="tiny"),
        "config.json: field 'rms_norm_eps' must be a finite number > 0, got 'tiny'",
    ),
    "a tokenizer.json cut short": (_tokenizer_cut_short, "tokenizer.json: not a tokenizer file (EOF while parsing"),
}
# the cases load_weights itself refuses, from the weights' headers
IN_THE_WEIGHTS = [
    "a tensor in two shards",
    "two tensors sharing bytes",
    "offsets into the header",
    "a span shorter than shape x dtype",
    "F32 bytes labelled I32",
    "an unknown dtype",
    "q_proj with a wrong column count",
    "gate_proj with a wrong column count",
    "a header entry without data_offsets",
    "a header that is a list",
]


def _broken(llama: Path, tmp_path: Path, case: str) -> Path:
    path = copy_checkpoint(llama, tmp_path / "broken")
    BROKEN[case][0](path)
    return path


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_checkpoint_is_one_line_naming_it_and_exit_2(case, llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = _broken(llama, tmp_path, case)
    code = main(["run", "--device", "cpu", "--model", str(path), "--no-plan-cache", "--prompt", "w5 w17"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("bootstrap: ")]
    assert len(lines) == 1 and BROKEN[case][1] in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", IN_THE_WEIGHTS)
def test_broken_weights_are_refused_before_any_weight_is_read(case, llama, tmp_path):
    path = _broken(llama, tmp_path, case)
    model = build_own_model(json.loads((llama / "config.json").read_text()), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    files = safetensors_files(path)
    with pytest.raises(ModelSourceError, match=re.escape(BROKEN[case][1])):
        load_weights(model, files)
    assert all(param.isnan().all() for param in model.parameters())  # nothing was read


def test_a_fifo_shard_is_refused_instead_of_blocking_the_load(llama, tmp_path):
    path = copy_checkpoint(llama, tmp_path / "fifo")
    shard = split_in_two(path)[1]
    shard.unlink()
    os.mkfifo(shard)  # no writer: opening it for reading would block forever
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    argv = ["run", "--device", "cpu", "--model", str(path), "--no-plan-cache", "--prompt", "w5"]
    done = subprocess.run(
        [sys.executable, "-m", "bootstrap.cli", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert done.returncode == 2, done.stderr
    assert "bootstrap: failed at stage 'resolve_classes'" in done.stderr
    assert f"{shard}: a FIFO, not a regular file" in done.stderr and "Traceback" not in done.stderr


def test_files_linked_to_regular_files_load_as_a_hub_snapshot_does(llama, tmp_path):
    """The Hugging Face cache keeps a checkpoint as links into a blob store: each link is followed."""
    from bootstrap.engine.sources.loader import load_model

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir(), snapshot.mkdir()
    for file in llama.iterdir():
        (blobs / file.name).write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blobs / file.name, snapshot), snapshot / file.name)
    loaded = load_model(str(snapshot), device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(loaded.model.model.norm.weight, load_file(llama / WEIGHTS)[NORM])
    assert loaded.tokenizer("w5 w33").input_ids == [5, 33]
