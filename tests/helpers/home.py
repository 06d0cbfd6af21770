"""The suite's own home: ``enter`` points HOME and XDG_CACHE_HOME at a fresh temporary folder
(every process a test starts inherits them), so the project's default caches
(``~/.cache/executor-bootstrap``: models, plans) are the suite's, never the user's. The default
model's files are hard-linked in from the real cache when it holds them (read, never written
there: every write of the project replaces files, so a link never carries one back)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

REAL_HOME = Path.home()  # read before ``enter``
REAL_CACHE = REAL_HOME / ".cache" / "executor-bootstrap"
_entered: list[Path] = []


def enter() -> Path:
    """Make the suite's home (once per process) and point the environment at it."""
    if _entered:
        return _entered[0]
    home = Path(tempfile.mkdtemp(prefix="bootstrap-suite-home-"))
    os.environ["HOME"] = str(home)
    os.environ["XDG_CACHE_HOME"] = str(home / ".cache")
    _entered.append(home)
    _seed_default_model(home / ".cache" / "executor-bootstrap")
    return home


def leave() -> None:
    """Remove the suite's home (its links only: the real files stay)."""
    for home in _entered:
        shutil.rmtree(home, ignore_errors=True)


def _seed_default_model(cache: Path) -> None:
    from bootstrap.engine.sources import smollm2

    if not smollm2.is_converted(REAL_CACHE):
        return  # the smollm2_cache fixture fetches it into the suite's home, or skips
    for source, target in (
        (smollm2.checkpoint_dir(REAL_CACHE), smollm2.checkpoint_dir(cache)),
        (smollm2.gguf_path(REAL_CACHE), smollm2.gguf_path(cache)),
    ):
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, copy_function=_link)
        elif source.is_file():
            _link(source, target)


def _link(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system: a copy
        shutil.copy2(source, target)
