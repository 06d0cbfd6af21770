"""A user's ``.gguf`` file, converted once to a checkpoint directory in the model cache.

Dequantizing a GGUF file through transformers costs the same on every start, while the
checkpoint directory it converts to loads fast, in the engine's own model code and without
importing transformers (benchmarks/README.md, "Figures without a saved result"). So the first
start converts the file as the default model is converted (``checkpoint.convert_gguf``: float32
safetensors, a clean ``config.json``, the tokenizer) into ``<cache>/gguf/<stem>-<key>/``, and
every later start loads that directory. ``key`` is the file's identity, not its content (a hash
would read the whole file on every start, the very cost this cache removes): the resolved path,
the size and the modification time in nanoseconds. A file rewritten in place gets a new key, and
its conversion replaces the older one at that path (``_drop_older``); a copy or a move converts
again. The directory holds ``source.json`` (that identity), which ``bootstrap cache list`` shows.
The weights are float32, 4 bytes a parameter whatever the quantization.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bootstrap.engine.sources.model_cache import CONVERTED, SOURCE_FILE, Entry, entry, is_checkpoint, is_staging, remove
from bootstrap.engine.sources.progress_lines import Progress, quiet

HEARTBEAT_S = 5.0  # while a conversion runs: a line this often (reading the GGUF says nothing for long)


def identity(gguf: Path) -> dict[str, Any]:
    """What says it is the same file: resolved path, size, modification time (ns)."""
    stat = gguf.stat()
    return {"path": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the conversion of ``gguf`` as it is now lives (it may not exist yet)."""
    key = hashlib.sha256(json.dumps(identity(gguf), sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)[:80].lstrip(".") or "model"
    return cache_dir / CONVERTED / f"{stem}-{key}"


def find(gguf: Path, cache_dir: Path) -> Path | None:
    """The complete conversion of ``gguf`` as it is now, or None."""
    target = converted_dir(gguf, cache_dir)
    return target if is_checkpoint(target) else None


def ensure_converted(gguf: Path, cache_dir: Path, progress: Progress = quiet) -> Path:
    """The checkpoint directory converted from ``gguf``, converting it on first use; ``OSError``
    (before the slow part) when the cache cannot be written."""
    target = converted_dir(gguf, cache_dir)
    if is_checkpoint(target):
        return target
    from bootstrap.engine.sources.checkpoint import convert_gguf  # torch: only to convert

    target.parent.mkdir(parents=True, exist_ok=True)
    with heartbeat(progress, f"converting {gguf.name} to a checkpoint (once)"):
        convert_gguf(gguf, target, progress, source={"gguf": identity(gguf)})
    _drop_older(target)
    return target


@contextlib.contextmanager
def heartbeat(progress: Progress, doing: str, interval_s: float | None = None) -> Iterator[None]:
    """While the block runs, ``"<doing>: still working, N s"`` every ``interval_s`` (default
    ``HEARTBEAT_S``) from a thread joined when it ends; nothing for ``quiet``."""
    if progress is quiet:
        yield
        return
    interval, stop, started = interval_s or HEARTBEAT_S, threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(interval):
            progress(f"{doing}: still working, {time.monotonic() - started:.0f} s")

    thread = threading.Thread(target=beat, name="bootstrap-conversion-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _drop_older(target: Path) -> None:
    """Remove the conversions of the same path made before the file changed."""
    path = _source_path(target)
    for other in target.parent.iterdir():
        if other != target and not is_staging(other) and _source_path(other) == path:
            remove(other)


def _source_path(converted: Path) -> str | None:
    try:
        return json.loads((converted / SOURCE_FILE).read_text(encoding="utf-8"))["gguf"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_entries(cache_dir: Path) -> list[Entry]:
    """Every conversion under ``cache_dir``, each with the file it came from (and whether that
    file has changed or gone since), and the staging of one under way or killed."""
    folder = cache_dir / CONVERTED
    if not folder.is_dir():
        return []
    return [entry(path, _describe(path)) for path in sorted(folder.iterdir())]


def _describe(converted: Path) -> str:
    if is_staging(converted):
        return "left by a conversion under way or killed"
    if not is_checkpoint(converted):
        return "an incomplete conversion"
    path = _source_path(converted)
    if path is None:
        return f"converted from a .gguf file (no readable {SOURCE_FILE})"
    try:
        now = converted_dir(Path(path), converted.parent.parent) == converted
    except OSError:
        return f"converted from {path} (that file is gone)"
    return f"converted from {path}" + ("" if now else " (that file has changed since)")
