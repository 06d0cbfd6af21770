"""A checkpoint's files, each checked to be a regular file before anything opens it (a FIFO would
block the load forever; a link loop would read as "no weights"), and its JSON files read with
errors that name the file. ``ModelSourceError`` is the engine's bad-model error (exit status 2);
``sources.loader`` re-exports it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bootstrap.config import ConfigError
from bootstrap.paths import open_regular

# what the loader (the engine's own and transformers') opens in a checkpoint directory
OPENED = ("*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken")


class ModelSourceError(ConfigError):
    """A model source that names nothing loadable, or a checkpoint that cannot be read; the
    message names the file or field (bad input of the ``model`` field: exit status 2)."""


def check_regular(file: Path) -> Path:
    """``file`` when it (or what its links lead to) is a regular file; else ``ModelSourceError``
    saying what it is, without opening it."""
    try:
        with open_regular(file.resolve(strict=True)):
            return file
    except RuntimeError:  # Python < 3.13: a link loop
        raise ModelSourceError(f"{file}: a symbolic link loop, not a regular file") from None
    except OSError as exc:
        raise ModelSourceError(f"{file}: {exc.strerror or exc}") from None


def check_checkpoint_files(path: Path) -> None:
    """Every file of the checkpoint directory ``path`` that a load opens is a regular file."""
    for pattern in OPENED:
        for file in sorted(path.glob(pattern)):
            check_regular(file)


def read_json(file: Path, kind: type | None = dict) -> Any:
    """The JSON in ``file`` (checked first), of type ``kind`` (None: any), or ``ModelSourceError``."""
    check_regular(file)
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"{file}: not valid JSON ({exc})") from None
    if kind is not None and not isinstance(value, kind):
        raise ModelSourceError(f"{file}: must hold a JSON {_NAMES.get(kind, kind)}, got {type(value).__name__}")
    return value


def exists(file: Path) -> bool:
    """``file`` is there, even as a broken link or a link loop (which ``check_regular`` then refuses)."""
    return os.path.lexists(file)


_NAMES = {dict: "object", list: "array"}
