"""``bootstrap cache list | clear``: what the plan cache and the model cache hold, and deleting it.

The plan cache (``--plan-cache``, default ``~/.cache/executor-bootstrap/plans``) holds one small
JSON file per setup; the model cache (``--model-cache``, default ``~/.cache/executor-bootstrap``)
the models ``run`` and ``serve`` fetched or converted (``bootstrap.engine.sources.model_cache``).
``list`` prints each with its size (decimal MB; kB below 0.1 MB), a plan with its setup (model,
``max_seq_len``, dtypes, device); ``clear`` deletes both (``--plans`` or ``--models``: only that
one) and prints what it removed. Only what these caches wrote is touched, however the directory was
named (``--plan-cache .`` included): plan files by name and first bytes
(``plan_cache.is_own_file``), model entries by place, name and content (``model_cache.is_own``),
never a link or what it points to. A folder goes only once the clear emptied it and only when it is
the caches' own (the plan directory ``PlanCache`` created, the model cache's ``downloads/`` and
``gguf/``, the default cache directory). Exit status 0; 2 for a cache path that is a file; 1 when
an entry could not be deleted (named). No torch import.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bootstrap.cli.args import DEFAULT_PLAN_CACHE, check_values_given
from bootstrap.cli.exits import OK, STAGE_FAILED
from bootstrap.config import ConfigError
from bootstrap.engine.sources import conversions, smollm2
from bootstrap.engine.sources.model_cache import (
    CONVERTED,
    DOWNLOADS,
    Entry,
    default_cache_dir,
    entry,
    is_own,
    remove,
    size_text,
)
from bootstrap.stages.plan_cache import ENTRY_NAME, MARKER, is_own_directory, is_own_file, stored_setup

PLAN = "plan"


def add_cache_args(cache: argparse.ArgumentParser) -> None:
    cache.add_argument(
        "action", choices=["list", "clear"], help="list: every cached plan and model with its size; clear: delete them"
    )
    only = cache.add_mutually_exclusive_group()
    only.add_argument("--plans", action="store_true", help="only the plan cache (default: both caches)")
    only.add_argument("--models", action="store_true", help="only the model cache (default: both caches)")
    cache.add_argument(
        "--plan-cache", type=Path, metavar="DIR", default=DEFAULT_PLAN_CACHE, help="the plan cache directory"
    )
    cache.add_argument(
        "--model-cache",
        type=Path,
        metavar="DIR",
        default=default_cache_dir(),
        help="the model cache directory: the models run and serve fetch and convert",
    )


@dataclass(frozen=True)
class Section:
    """One cache: its entries, and the folders of its own that clearing removes once empty
    (never a folder the cache did not create: see the module's docstring)."""

    label: str
    directory: Path
    entries: list[Entry]
    folders: tuple[Path, ...] = ()


def main_cache(args: argparse.Namespace) -> int:
    check_values_given(args)
    sections = []
    if not args.models:
        plans = _directory(args.plan_cache, "--plan-cache")
        own = (plans,) if is_own_directory(plans) else ()
        sections.append(Section("cached plan(s)", plans, plan_entries(plans), own))
    if not args.plans:
        models = _directory(args.model_cache, "--model-cache")
        entries = model_entries(models)
        sections.append(Section("model cache entries", models, entries, model_folders(models, entries)))
    if args.action == "list":
        for section in sections:
            print_section(f"{len(section.entries)} {section.label} in {shown(section.directory)}", section)
        return OK
    failed = [clear(section) for section in sections]
    return STAGE_FAILED if any(failed) else OK


def _directory(path: Path, flag: str) -> Path:
    """``path`` expanded; ``ConfigError`` naming ``flag`` when it is a file (a missing one is empty)."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}: {path} is a file, not a cache directory")
    return path


def plan_entries(directory: Path) -> list[Entry]:
    """The plans and killed stores' temporary files in ``directory``; nothing else it holds."""
    if not directory.is_dir():
        return []
    try:
        names = sorted(directory.iterdir())
    except OSError as exc:
        raise ConfigError(f"--plan-cache: cannot list {directory}: {exc.strerror or exc}") from None
    return [entry(path, PLAN) for path in names if is_own_file(path)]


def model_entries(directory: Path) -> list[Entry]:
    """The model cache's own entries: the default model's, and the converted GGUF files."""
    if not directory.is_dir():
        return []
    listed = smollm2.cache_entries(directory) + conversions.cache_entries(directory)
    return [e for e in listed if is_own(e.path, directory)]


def model_folders(directory: Path, entries: list[Entry]) -> tuple[Path, ...]:
    """The layout's folders that hold entries (the cache's writers created them), and the default
    cache directory: what a clear may remove once it has emptied them."""
    held = {e.path.parent for e in entries}
    layout = tuple(f for f in (directory / DOWNLOADS, directory / CONVERTED) if f in held)
    return layout + ((directory,) if directory == default_cache_dir() else ())


def print_section(
    title: str, section: Section, entries: list[Entry] | None = None, whats: dict[Path, str] | None = None
) -> None:
    """``title: <total size>``, then one line per entry: its size, its name, and what it is (a
    plan: the setup it was measured for; ``whats``: as read before the entries were removed)."""
    entries = section.entries if entries is None else entries
    whats = whats or describe(entries)
    print(f"{title}: {size_text(sum(e.size_bytes for e in entries))}")
    for e in entries:
        print(f"  {size_text(e.size_bytes):>10}  {shown(e.path.relative_to(section.directory))}  {whats[e.path]}")


def describe(entries: list[Entry]) -> dict[Path, str]:
    """What each entry is, in words (a plan's read from its file)."""
    return {e.path: plan_text(e.path) if e.what == PLAN else e.what for e in entries}


def plan_text(path: Path) -> str:
    """A plan's setup in words: the model, ``max_seq_len``, the dtypes, the batch limits, the
    device and backend."""
    if not ENTRY_NAME.fullmatch(path.name):
        return "left by a plan store under way or killed"
    about = stored_setup(path)
    if about is None:
        return "a plan whose setup is not recorded (stored by an older version)"
    quantized = f" ({about['quantization']} weights)" if about.get("quantization") else ""
    tp = f", tp {about['tp']}" if about.get("tp", 1) != 1 else ""
    device_gib = float(about.get("device_total_bytes") or 0) / 2**30
    return (
        f"{about.get('model')}: max_seq_len {about.get('max_seq_len')}, {about.get('dtype')}{quantized}, "
        f"KV {about.get('kv_dtype')}, max_batch_size {about.get('max_batch_size')}, "
        f"max_num_tokens {about.get('max_num_tokens')}{tp}, {about.get('device')} ({device_gib:.1f} GiB), "
        f"{about.get('backend')} backend"
    )


def shown(path: Path) -> str:
    """``path`` as any stdout takes it: a byte that is not UTF-8 (a lone surrogate in the str)
    is written as ``\\xff`` instead of failing the print."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def clear(section: Section) -> bool:
    """Delete the section's entries, then its folders and directory where that left them empty,
    and say what went; True if an entry could not be deleted (each is named on stderr)."""
    removed, failed, whats = [], False, describe(section.entries)  # a plan's setup is read from its file
    for e in section.entries:
        try:
            remove(e.path)
            removed.append(e)
        except OSError as exc:
            print(f"bootstrap: could not delete {e.path}: {exc.strerror or exc}", file=sys.stderr)
            failed = True
    for folder in section.folders:
        _remove_if_empty(folder)
    print_section(f"removed {len(removed)} {section.label} from {shown(section.directory)}", section, removed, whats)
    return failed


def _remove_if_empty(directory: Path) -> None:
    """``directory`` when nothing is left in it but the plan cache's own ``MARKER``."""
    try:
        if os.listdir(directory) == [MARKER] and is_own_directory(directory):
            (directory / MARKER).unlink()
        directory.rmdir()
    except OSError:  # not empty (other files are not ours to delete), or already gone
        pass
