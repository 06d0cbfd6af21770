"""Local Hugging Face checkpoint directories and GGUF files, read without any network access.

Also writes the fast-loading form of a GGUF-loaded model (``convert_gguf``): transformers marks
such a model as quantized and refuses ``save_pretrained`` on it, although its weights are plain
tensors, so the state dict goes to safetensors directly (float32, as dequantized), next to a
cleaned ``config.json``, the tokenizer and a ``source.json`` saying what it was converted from.
The directory is written under a temporary name and renamed into place
(``model_cache.publish``), so an interrupted conversion never leaves a half-written cache
behind; the conversion reports its start and, at the end, the time it took (``progress``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_model

from bootstrap.engine.layers.attention import ATTN_IMPLEMENTATION, register
from bootstrap.engine.layers.linear import Shard
from bootstrap.engine.models import load_own_model
from bootstrap.engine.models.files import ModelSourceError
from bootstrap.engine.sources.model_cache import SOURCE_FILE, publish, size_of, size_text
from bootstrap.engine.sources.progress_lines import Progress, quiet
from bootstrap.engine.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# config keys that describe the GGUF container, not the model
_GGUF_ONLY_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")


def _model_kwargs(dtype: torch.dtype | None, attn_implementation: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype or "auto"}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def load_checkpoint_dir(
    path: Path,
    device: torch.device,
    dtype: torch.dtype | None,
    attn_implementation: str | None,
    tp_size: int = 1,
    background: bool = False,
    tokenizer_of: Callable[[Path], Any] | None = None,
    quantize: str | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Model (eval mode, on ``device``) and tokenizer (None without tokenizer files).

    ``tp_size`` > 1 (inside an initialised torch.distributed group of that size): this rank's
    shard, read at load into the engine's own column- and row-parallel layers; a model on the
    transformers path shards through its tensor-parallel plan (``tp_plan="auto"``: DTensor
    parameters, placed on ``cuda:LOCAL_RANK`` or the CPU by transformers itself)."""
    model = own_model(path, device, dtype, attn_implementation, tp_size, background, quantize)
    if model is None and quantize is not None:
        raise ModelSourceError(f"quantization: {quantize} needs a model on the engine's own code; {path} is not")
    if model is None:
        model = _transformers_model(path, device, dtype, attn_implementation, tp_size)
    return model.eval(), (tokenizer_of or checkpoint_tokenizer)(path)


def _transformers_model(
    path: Path, device: torch.device, dtype: torch.dtype | None, attn_implementation: str | None, tp_size: int
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    register()
    kwargs = _model_kwargs(dtype, attn_implementation)
    if tp_size > 1:
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    else:
        kwargs["device_map"] = device
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def checkpoint_tokenizer(path: Path) -> Any:
    """The engine's own tokenizer where ``tokenizer.json`` serves as it is
    (``bootstrap.engine.tokenizer``), else transformers'; None without tokenizer files."""
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    own = load_tokenizer(path)
    if own is not None:
        return own
    from transformers import AutoTokenizer

    log.info(
        "tokenizer of %s loads through transformers (no tokenizer.json, or a tokenizer class that "
        "rebuilds its pipeline)",
        path,
    )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def own_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype | None,
    attn_implementation: str | None,
    tp_size: int,
    background: bool = False,
    quantize: str | None = None,
) -> torch.nn.Module | None:
    """The engine's own model code for this checkpoint (``bootstrap.engine.models``) with the
    paged attention, this rank's shard at ``tp_size`` > 1; None keeps it on transformers."""
    if attn_implementation not in (None, ATTN_IMPLEMENTATION):
        return None
    shard = Shard(torch.distributed.get_rank(), tp_size) if tp_size > 1 else Shard()
    return load_own_model(path, device, dtype, shard, background, quantize)


def load_gguf_file(
    path: Path, device: torch.device, dtype: torch.dtype | None, attn_implementation: str | None
) -> tuple[torch.nn.Module, Any]:
    """Model dequantized from a GGUF file (eval mode, on ``device``) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register()
    where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    kwargs = _model_kwargs(dtype, attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(**where, **kwargs).to(device)
    tokenizer = AutoTokenizer.from_pretrained(**where, local_files_only=True)
    return model.eval(), tokenizer


def gguf_config(path: Path, progress: Progress = quiet) -> PretrainedConfig:
    """The model config stored in a GGUF file's metadata, without the weights (transformers reads
    every field, the vocabulary too: seconds for a real model, so it reports to ``progress``)."""
    from transformers import AutoConfig

    started, doing = time.monotonic(), f"reading the model config of {path.name} from its GGUF metadata"
    progress(f"{doing} ...")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    progress(f"{doing}: done in {time.monotonic() - started:.1f} s")
    return config


@contextlib.contextmanager
def no_bars() -> Iterator[None]:
    """transformers' tqdm bars off while it converts a GGUF file: they drew over the lines this
    package prints on the same stream (``progress``), which say the same. Its loading bar obeys
    its own switch; its GGUF module calls ``tqdm.auto.tqdm`` by name, so that name is bound to a
    disabled bar for the conversion only (one at a time: the device thread); both restored."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar, was_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if was_on:
            hf_logging.enable_progress_bar()


def clean_config_dict(config: PretrainedConfig) -> dict[str, Any]:
    """A copy of ``config`` as a dict, without the GGUF container's quantization marks."""
    values = config.to_dict()
    for key in _GGUF_ONLY_KEYS:
        values.pop(key, None)
    return values


def without_gguf_marks(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a GGUF-loaded model's config without the quantization marks (weights are plain)."""
    clean = copy.deepcopy(config)
    if hasattr(clean, "quantization_config"):
        delattr(clean, "quantization_config")
    return clean


def convert_gguf(
    gguf_path: Path, target: Path, progress: Progress = quiet, source: Mapping[str, Any] | None = None
) -> Path:
    """Write a GGUF model as a plain checkpoint dir at ``target`` (atomic); return ``target``.
    ``source``: what it was converted from, kept as ``source.json`` (``bootstrap cache list``)."""
    started, doing = time.monotonic(), f"converting {gguf_path.name} to a checkpoint (once)"
    progress(f"{doing}: {size_text(gguf_path.stat().st_size)} of GGUF, dequantized into {target} ...")
    with no_bars():
        model, tokenizer = load_gguf_file(gguf_path, torch.device("cpu"), None, None)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config_text = json.dumps(clean_config_dict(model.config), indent=2, sort_keys=True)
        (staging / "config.json").write_text(config_text + "\n")
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if source is not None:
            (staging / SOURCE_FILE).write_text(json.dumps(source, indent=1, sort_keys=True) + "\n")
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"{doing}: done in {time.monotonic() - started:.1f} s, {size_text(size_of(target))} in {target}")
    return target
