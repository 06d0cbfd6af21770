"""What a live operation's client may name: a model source or a weights directory the server can
read. Anything else is one 400 that reads the same whatever the path is (missing, unreadable, a
file of another kind, a directory without config.json or weights, a ``random:`` file that holds
no config), so a client learns nothing of the server's files beyond the checkpoints it may load.
The command line (``bootstrap run``, ``serve --model``) keeps the loader's more helpful messages:
there the operator names their own files. Checked on a worker thread (a directory is listed)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from bootstrap.engine.sources.model_cache import WEIGHT_PATTERNS
from bootstrap.engine.sources.random_spec import PREFIX, preset_names
from bootstrap.engine.sources.smollm2 import NAME as DEFAULT_MODEL
from bootstrap.serve.errors import APIError

MAX_CONFIG_BYTES = 1 << 20  # a config.json named after ``random:`` is read whole at most this long
NOT_A_MODEL = (
    "model: not a checkpoint directory (config.json and weights), .gguf file, preset, or 'random:' with a preset "
    f"or a config.json, that the server can read; allowed: one of those, or {DEFAULT_MODEL!r}"
)
NOT_WEIGHTS = "{field}: not a checkpoint directory (config.json and *.safetensors) that the server can read"


def check_model(text: str, backend: str) -> None:
    """``text``, a swap's ``model``, names a source the native engine may load, else ``NOT_A_MODEL``
    (another backend names its models its own way: its own checks answer)."""
    if backend != "native":
        return
    spec, presets = text.strip(), preset_names()
    if spec == DEFAULT_MODEL or spec in presets:
        return
    if spec.startswith(PREFIX):
        rest = spec[len(PREFIX) :].strip()
        if rest in presets or _holds_config(Path(rest).expanduser()):
            return
    elif _checkpoint(Path(spec).expanduser(), WEIGHT_PATTERNS) or _gguf(Path(spec).expanduser()):
        return
    raise APIError(400, NOT_A_MODEL, param="model", code="operation_refused")


def check_weights_path(path: str, field: str) -> None:
    """``path``, new weights in place, is a checkpoint directory with safetensors, else ``NOT_WEIGHTS``."""
    if not _checkpoint(Path(path).expanduser(), ("*.safetensors",)):
        raise APIError(400, NOT_WEIGHTS.format(field=field), param=field, code="operation_refused")


def _checkpoint(path: Path, patterns: tuple[str, ...]) -> bool:
    try:
        readable = path.is_dir() and os.access(path, os.R_OK | os.X_OK) and _readable(path / "config.json")
        return readable and any(any(path.glob(p)) for p in patterns)
    except (OSError, ValueError):
        return False


def _gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and _readable(path)


def _readable(file: Path) -> bool:
    """A regular file (through its links) that opens for reading, without blocking on a FIFO."""
    return _read(file, None) is not None


def _holds_config(path: Path) -> bool:
    """A config.json (``path``, or the one in that directory) holding an object with a ``model_type``."""
    text = _read(path / "config.json" if path.is_dir() else path, MAX_CONFIG_BYTES)
    try:
        config = json.loads(text) if text else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str)


def _read(file: Path, limit: int | None) -> bytes | None:
    """``file``'s bytes (a regular file through its links; none read when ``limit`` is None); None
    when it is no such file, cannot be opened, or is longer than ``limit``."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens without a writer
    except (OSError, ValueError):
        return None
    try:
        size = os.fstat(fd)
        if not stat.S_ISREG(size.st_mode) or (limit is not None and size.st_size > limit):
            return None
        return b"" if limit is None else os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
