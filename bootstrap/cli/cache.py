"""``bootstrap cache list | clear``: what the plan cache and the model cache hold, and deleting it.

The plan cache (``--plan-cache``, default ``~/.cache/executor-bootstrap/plans``) holds one small
JSON file per setup. The model cache (``--model-cache``, default ``~/.cache/executor-bootstrap``,
where ``run`` and ``serve`` keep models) holds the default model's GGUF and its converted
checkpoint, and every ``.gguf`` file converted once (``bootstrap.engine.sources.model_cache``).
``list`` prints each with its size; ``clear`` deletes both (``--plans`` or ``--models``: only that
one) and prints what it removed and how much. Only what these caches write is touched: plan
files, and the model cache's own entries, never another file in those directories. Sizes in
decimal MB (10^6 bytes). Exit status 0; 2 for a cache path that is a file; 1 when an entry could
not be deleted (the message names it). No torch is imported.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from bootstrap.cli.args import DEFAULT_PLAN_CACHE
from bootstrap.cli.exits import OK, STAGE_FAILED
from bootstrap.config import ConfigError
from bootstrap.engine.sources import conversions, smollm2
from bootstrap.engine.sources.model_cache import (
    CONVERTED,
    DOWNLOADS,
    Entry,
    default_cache_dir,
    entry,
    remove,
    size_text,
)

PLAN = "plan"
PLAN_PATTERNS = ("*.json", "*.tmp")  # a plan, and the temporary file of a store that was killed


def add_cache_args(cache: argparse.ArgumentParser) -> None:
    cache.add_argument("action", choices=["list", "clear"],
                       help="list: every cached plan and model with its size; clear: delete them")  # fmt: skip
    only = cache.add_mutually_exclusive_group()
    only.add_argument("--plans", action="store_true", help="only the plan cache (default: both caches)")
    only.add_argument("--models", action="store_true", help="only the model cache (default: both caches)")
    cache.add_argument("--plan-cache", type=Path, metavar="DIR", default=DEFAULT_PLAN_CACHE,
                       help="the plan cache directory")  # fmt: skip
    cache.add_argument("--model-cache", type=Path, metavar="DIR", default=default_cache_dir(),
                       help="the model cache directory: the models run and serve fetch and convert")  # fmt: skip


@dataclass(frozen=True)
class Section:
    """One cache: its entries, and the folders of its own that clearing removes once empty."""

    label: str
    directory: Path
    entries: list[Entry]
    folders: tuple[Path, ...] = ()


def main_cache(args: argparse.Namespace) -> int:
    sections = []
    if not args.models:
        plans = _directory(args.plan_cache, "--plan-cache")
        sections.append(Section("cached plan(s)", plans, plan_entries(plans)))
    if not args.plans:
        models = _directory(args.model_cache, "--model-cache")
        sections.append(Section("model cache entries", models, model_entries(models),
                                (models / DOWNLOADS, models / CONVERTED)))  # fmt: skip
    if args.action == "list":
        for section in sections:
            print_section(f"{len(section.entries)} {section.label} in {section.directory}", section)
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
    if not directory.is_dir():
        return []
    return [entry(path, PLAN) for pattern in PLAN_PATTERNS for path in sorted(directory.glob(pattern))]


def model_entries(directory: Path) -> list[Entry]:
    """The model cache's own entries: the default model's, and the converted GGUF files."""
    if not directory.is_dir():
        return []
    return smollm2.cache_entries(directory) + conversions.cache_entries(directory)


def print_section(title: str, section: Section, entries: list[Entry] | None = None) -> None:
    """``title: <total size>``, then one line per model cache entry (plans are files named by
    their fingerprint, so their count says it)."""
    entries = section.entries if entries is None else entries
    print(f"{title}: {size_text(sum(e.size_bytes for e in entries))}")
    for e in entries:
        if e.what != PLAN:
            print(f"  {size_text(e.size_bytes):>10}  {e.path.relative_to(section.directory)}  {e.what}")


def clear(section: Section) -> bool:
    """Delete the section's entries, then its folders and directory where that left them empty,
    and say what went; True if an entry could not be deleted (each is named on stderr)."""
    removed, failed = [], False
    for e in section.entries:
        try:
            remove(e.path)
            removed.append(e)
        except OSError as exc:
            print(f"bootstrap: could not delete {e.path}: {exc.strerror or exc}", file=sys.stderr)
            failed = True
    for folder in (*section.folders, section.directory):
        _remove_if_empty(folder)
    print_section(f"removed {len(removed)} {section.label} from {section.directory}", section, removed)
    return failed


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (other files are not ours to delete), or already gone
        pass
