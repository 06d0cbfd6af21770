"""The second start of every model source kind finds the plan its first start stored.

Each start is a fresh process state as far as the pipeline sees: a new ``Bootstrap`` on a new
native backend (CPU), sharing only the plan cache and the model cache directories. The second
start skips ``estimation_build`` and ``profiling`` (reason ``plan-cache``), and one plan is
stored, not two: the first start of a ``.gguf`` file or of the default model reads the model's
config from the GGUF file, every later one from the checkpoint converted from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.tiny_gguf import write_tiny_gguf
from helpers.tiny_models import build, save_checkpoint

from bootstrap.api import Bootstrap
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.config import BootstrapConfig
from bootstrap.devices import CpuDevice
from bootstrap.engine.sources import smollm2
from bootstrap.engine.sources.progress_lines import quiet

SMALL = dict(device="cpu", max_num_tokens=64, max_batch_size=4, max_seq_len=128)
PROBED, FROM_CACHE = ("ok", None), ("skipped", "plan-cache")


def checkpoint_dir(root: Path) -> str:
    return str(save_checkpoint("llama", root / "llama"))


def gguf_file(root: Path) -> str:
    return str(write_tiny_gguf(root / "tiny.gguf", build("llama")))


def random_preset(root: Path) -> str:
    return "random:smollm2-135m"


def default_model(root: Path) -> str:
    """The default model, its GGUF already in the (empty otherwise) model cache: a tiny one."""
    smollm2.gguf_path(root / "models").parent.mkdir(parents=True)
    write_tiny_gguf(smollm2.gguf_path(root / "models"), build("llama"))
    return smollm2.NAME


KINDS: dict[str, Callable[[Path], str]] = {
    "checkpoint directory": checkpoint_dir,
    "gguf file": gguf_file,
    "random preset": random_preset,
    "default model": default_model,
}


async def start(model: str, root: Path) -> dict[str, tuple[str, str | None]]:
    """One build and release; each stage's (outcome, skip reason)."""
    config = BootstrapConfig(model=model, plan_cache=root / "plans", **SMALL)
    backend = NativeBackend(CpuDevice(), torch.device("cpu"), cache_dir=root / "models", progress=quiet)
    boot = Bootstrap(config, backend=backend)
    try:
        await boot.build()
        return {row["id"]: (row["outcome"], row["skip_reason"]) for row in boot.report().stages}
    finally:
        await boot.aclose()


async def two_starts(model: str, root: Path) -> None:
    first = await start(model, root)
    assert first["estimation_build"] == first["profiling"] == PROBED
    second = await start(model, root)
    assert second["estimation_build"] == second["profiling"] == FROM_CACHE
    assert len(list((root / "plans").glob("*.json"))) == 1  # the second start stored no plan of its own


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_the_second_start_of_every_source_kind_reuses_the_plan(kind, tmp_path):
    await two_starts(KINDS[kind](tmp_path), tmp_path)


@pytest.mark.slow
async def test_the_second_start_of_the_real_default_model_reuses_the_plan(smollm2_cache, tmp_path):
    """SmolLM2 itself, from a fresh machine's state: only its GGUF in the cache (linked from the
    fixture's download, so no network), converted by the first start (about 25 s)."""
    gguf = smollm2.gguf_path(tmp_path / "models")
    gguf.parent.mkdir(parents=True)
    os.symlink(smollm2.gguf_path(smollm2_cache), gguf)
    await two_starts(smollm2.NAME, tmp_path)
    assert smollm2.is_converted(tmp_path / "models")
