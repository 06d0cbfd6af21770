"""File-system checks the rooms share: a directory made or a ``ConfigError`` saying what is in the
way, a regular file opened without following a link or blocking on a FIFO, a ``stat`` mode in
words. A leaf: it imports only ``ConfigError`` from ``bootstrap.config``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from bootstrap.config import ConfigError


def ensure_directory(path: Path, field: str) -> Path:
    """Create ``path`` and its parents, or raise ``ConfigError`` naming ``field`` and why: a file
    in the way is reported as "<file> is not a directory" (``mkdir`` alone says "File exists")."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = file_in_the_way(path)
        reason = f"{blocker} is not a directory" if blocker else exc.strerror or str(exc)
        raise ConfigError(f"{field}: cannot write to {path}: {reason}") from None
    return path


def file_in_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its parents that exists and is no directory: a mistyped path,
    not a read-only disk (``mkdir`` says only "File exists" or "Not a directory")."""
    for candidate in (path, *path.parents):
        try:
            if not stat.S_ISDIR(os.stat(candidate).st_mode):
                return candidate
        except OSError:  # absent, or not ours to look into
            continue
    return None


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[int]:
    """A read-only descriptor of ``path`` when it is a regular file; a link, FIFO, device or
    directory raises ``OSError`` saying which before anything is followed or blocks (``lstat``
    first, then ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat`` for a file replaced in between)."""
    _require_regular(path, os.lstat(path))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular(path, os.fstat(fd))
        yield fd
    finally:
        os.close(fd)


def _require_regular(path: Path, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{file_kind(st.st_mode)}, not a regular file")


def file_kind(mode: int) -> str:
    """What a ``stat`` mode that is no regular file is, in words (\"a FIFO\")."""
    kinds = {
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "a special file")
