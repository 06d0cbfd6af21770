"""``bootstrap cache clear``: delete every cached plan."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from bootstrap.cli.args import DEFAULT_PLAN_CACHE
from bootstrap.cli.exits import OK


def add_cache_args(cache: argparse.ArgumentParser) -> None:
    cache.add_argument("action", choices=["clear"], help="clear: delete every cached plan")
    cache.add_argument("--plan-cache", type=Path, default=DEFAULT_PLAN_CACHE, help="the cache directory")


def main_cache(args: argparse.Namespace) -> int:
    directory = args.plan_cache.expanduser()
    count = len(list(directory.glob("*.json"))) if directory.is_dir() else 0
    shutil.rmtree(directory, ignore_errors=True)
    print(f"removed {count} cached plan(s) from {directory}")
    return OK
