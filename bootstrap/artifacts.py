"""Typed, immutable artifacts that stages hand to each other.

Artifacts that wrap live backend objects (a loaded model, a KV pool, an executor) hold them in a
``handle`` field; the artifact itself is frozen, and releasing the handle is the job of the undo
actions its stage registered (see ``bootstrap.undo.Undo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bootstrap.capacity import CacheCost
from bootstrap.models.shape import ModelShape


@dataclass(frozen=True)
class ResolvedClasses:
    """Stage 1: everything decided from the config and the model's config.json, before any load."""

    shape: ModelShape
    draft_shape: ModelShape | None
    kv_layout: str  # "mha" | "gqa" | "mqa" | "mla", with "+swa" / "+recurrent" suffixes
    cost: CacheCost  # target KV bytes per token on one rank
    draft_cost: CacheCost | None
    cross_cost: CacheCost | None
    max_seq_len: int
    dtype: str  # weights, resolved from "auto"
    kv_dtype: str  # KV cache, resolved from "auto"
    kv_manager: str
    scheduler: str
    sampler: str

    @property
    def total_cost(self) -> CacheCost:
        """KV bytes per token for all pools together (target + draft + cross)."""
        total = self.cost
        for extra in (self.draft_cost, self.cross_cost):
            if extra is not None:
                total = total + extra
        return total


@dataclass(frozen=True)
class LoadedModel:
    """Stage 2: weights (and draft weights) on the device, and the tokenizer."""

    handle: Any
    weight_bytes: int
    draft_handle: Any = None
    tokenizer: Any = None


@dataclass(frozen=True)
class EstimationBuild:
    """Stage 3: probe KV pools sized for the dummy workload, and a temporary executor."""

    handle: Any
    probe_tokens: int
    probe_kv_bytes: int
    max_num_tokens: int  # the dummy workload this probe was sized for


@dataclass(frozen=True)
class FinalBuild:
    """Stage 7: the final KV pools, by pool name (target, draft, cross)."""

    handle: Any
    pool_bytes: dict[str, int] = field(default_factory=dict)
    pool_tokens: dict[str, int] = field(default_factory=dict)
