"""This process's place among the ranks, as the launcher set it (no torch import: the CLI reads
it before it decides whether to import anything heavy)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, set by ``torchrun`` or ``bootstrap run --tp N``."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> RankEnv | None:
        """None when no launcher set ``RANK`` and ``WORLD_SIZE``."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)))
