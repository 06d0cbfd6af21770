"""The model cache directory: where converted and fetched models are kept, and its entries.

``~/.cache/executor-bootstrap`` unless a caller names another (``cache_dir`` of the loader):

    downloads/SmolLM2-135M-Instruct.Q4_1.gguf   the default model's GGUF, as fetched from PyPI
    smollm2-135m-instruct-q4_1/                 the default model, converted once (``smollm2``)
    gguf/<stem>-<key>/                          a user's .gguf file, converted once (``conversions``)
    plans/                                      the CLI's plan cache (not a model: listed apart)
    .<name>.<random>                            the staging of a fetch or conversion under way, or killed

Every entry is written under a staging name and renamed into place (``publish``), so a reader
never sees half of one. Nothing here imports torch: ``bootstrap cache`` lists and clears the
cache without it. Sizes are file sizes in bytes; ``size_text`` prints them in decimal MB
(10^6 bytes, as pip does).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
DOWNLOADS = "downloads"
CONVERTED = "gguf"
SOURCE_FILE = "source.json"  # in a converted checkpoint: what it was converted from


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "executor-bootstrap"


def has_weights(path: Path) -> bool:
    """True when ``path`` holds safetensors or PyTorch weight files."""
    return any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS)


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint directory: a ``config.json`` and weights."""
    return (path / "config.json").is_file() and has_weights(path)


def publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` (a dir or file) to ``target``. A complete checkpoint that a concurrent
    writer published first wins; an incomplete leftover (no config or no weights) is replaced."""
    try:
        os.rename(staging, target)
    except OSError:
        if is_checkpoint(target):
            return
        if not target.is_dir():
            raise
        shutil.rmtree(target)
        os.rename(staging, target)


@dataclass(frozen=True)
class Entry:
    """One thing the model cache holds: a file or a directory, what it is, and its size."""

    path: Path
    what: str
    size_bytes: int


def entry(path: Path, what: str) -> Entry:
    return Entry(path, what, size_of(path))


def is_staging(path: Path) -> bool:
    """A name this cache writes under before ``publish`` (``tempfile.mkdtemp(prefix=".<name>.")``)."""
    return path.name.startswith(".")


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (links not followed); 0 if it is gone."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except FileNotFoundError:
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # removed while we walked
                pass
    return total


def remove(path: Path) -> None:
    """Delete a cache entry, file or directory; ``OSError`` if it cannot be deleted."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def size_text(size_bytes: int) -> str:
    """``"538.1 MB"``; below 0.1 MB in kB (``"3.6 kB"``), so that a few small files show."""
    if 0 < size_bytes < 100_000:
        return f"{size_bytes / 1e3:.1f} kB"
    return f"{size_bytes / 1e6:.1f} MB"
