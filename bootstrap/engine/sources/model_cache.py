"""The model cache directory: where converted and fetched models are kept, and its entries.

``~/.cache/executor-bootstrap`` unless a caller names another (``cache_dir`` of the loader):

    downloads/SmolLM2-135M-Instruct.Q4_1.gguf   the default model's GGUF, as fetched from PyPI
    smollm2-135m-instruct-q4_1/                 the default model, converted once (``smollm2``)
    gguf/<stem>-<key>/                          a user's .gguf file, converted once (``conversions``)
    plans/                                      the CLI's plan cache (not a model: listed apart)
    .<name>.<random>                            the staging of a fetch or conversion under way, or killed

Every entry is written under a staging name and renamed into place (``publish``). ``is_own``
tells these entries from anything else a directory holds, by place, name and content where an
entry has some (``bootstrap cache`` lists and clears only those). No torch import here. Sizes
are file sizes in bytes; ``size_text`` prints them in decimal MB (10^6 bytes, as pip does).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from bootstrap.paths import open_regular

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
DOWNLOADS = "downloads"
CONVERTED = "gguf"
SOURCE_FILE = "source.json"  # in a converted checkpoint: what it was converted from
GGUF_MAGIC = b"GGUF"  # how every GGUF file begins
CONVERTED_NAME = re.compile(r"[A-Za-z0-9._-]*-[0-9a-f]{16}")  # conversions.converted_dir: <stem>-<key>
STAGING_NAME = re.compile(r"\.(?P<target>[A-Za-z0-9._-]+)\.[a-z0-9_]+")  # mkdtemp(prefix=".<target>.")
MAX_SOURCE_BYTES = 1 << 16  # a source.json is a few hundred bytes


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


def is_own(path: Path, cache_dir: Path) -> bool:
    """True when ``path``, listed as an entry of ``cache_dir``, is recognisably this cache's own:
    never a link, nor anything in a linked folder; a file only as a GGUF (its magic); a staging
    directory by the name its writer gives it (its content is partial by design); a checkpoint
    by its name (``<stem>-<key>`` in ``gguf/``) and its ``source.json`` or config and weights."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return False
    if path.parent != cache_dir and path.parent.is_symlink():
        return False
    if stat.S_ISREG(mode):
        return path.suffix == ".gguf" and _head(path, len(GGUF_MAGIC)) == GGUF_MAGIC
    if not stat.S_ISDIR(mode):
        return False
    converted = path.parent == cache_dir / CONVERTED
    if is_staging(path):
        name = STAGING_NAME.fullmatch(path.name)
        return name is not None and (not converted or CONVERTED_NAME.fullmatch(name["target"]) is not None)
    if converted and not CONVERTED_NAME.fullmatch(path.name):
        return False
    return _has_source(path) or is_checkpoint(path)


def _has_source(checkpoint: Path) -> bool:
    """A ``source.json`` as the conversion writes it: a JSON object naming the ``gguf``."""
    blob = _head(checkpoint / SOURCE_FILE, MAX_SOURCE_BYTES + 1)
    if blob is None or len(blob) > MAX_SOURCE_BYTES:
        return False
    try:
        data = json.loads(blob.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "gguf" in data


def _head(path: Path, size: int) -> bytes | None:
    """Up to ``size`` first bytes of the regular file ``path``; None for anything else (a link is
    not followed, a FIFO or device never opened: ``paths.open_regular``)."""
    try:
        with open_regular(path) as fd:
            return os.read(fd, size)
    except OSError:
        return None


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
            with contextlib.suppress(FileNotFoundError):  # removed while we walked
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def remove(path: Path) -> None:
    """Delete a cache entry, file or directory (a link itself, never what it points to);
    ``OSError`` if it cannot be deleted."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def size_text(size_bytes: int) -> str:
    """``"538.1 MB"``; below 0.1 MB in kB (``"3.6 kB"``), so that a few small files show."""
    if 0 < size_bytes < 100_000:
        return f"{size_bytes / 1e3:.1f} kB"
    return f"{size_bytes / 1e6:.1f} MB"
