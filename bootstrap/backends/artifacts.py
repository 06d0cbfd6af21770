"""Typed, immutable artifacts that stages hand to each other.

Artifacts that wrap live backend objects (a loaded model, a KV pool, an executor) hold them in a
``handle`` field; the artifact itself is frozen, and releasing the handle is the job of the undo
actions its stage registered (see ``bootstrap.pipeline.undo.Undo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bootstrap.capacity import CacheCost, kv_dtype_bytes, probe_cost
from bootstrap.capacity.rules import MemoryRule
from bootstrap.capacity.shape import ModelShape
from bootstrap.pipeline.undo import Undo


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
    memory_rule: MemoryRule  # resolved once; the probe cap and the plan both apply it

    @property
    def total_cost(self) -> CacheCost:
        """KV bytes per token for all pools together (target + draft + cross)."""
        total = self.cost
        for extra in (self.draft_cost, self.cross_cost):
            if extra is not None:
                total = total + extra
        return total

    def probe_cost(self, *, tp: int, max_batch_size: int) -> CacheCost:
        """KV bytes per token of the estimation probe for target and draft: every layer holds
        every probe token, no per-sequence window state (``bootstrap.capacity.probe_cost``)."""
        shapes = (self.shape, self.draft_shape)
        return probe_cost(shapes, kv_dtype_bytes=kv_dtype_bytes(self.kv_dtype), tp=tp, max_batch_size=max_batch_size)


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
    # The releases of this build, set by the estimation_build stage. Profiling runs them to tear
    # the probe down before it rebuilds a smaller one; running them again does nothing, so an
    # empty ``release`` means the probe is gone. None: built outside the stage, not releasable early.
    release: Undo | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class FinalBuild:
    """Stage 7: the final KV pools, by pool name (target, draft, cross)."""

    handle: Any
    pool_bytes: dict[str, int] = field(default_factory=dict)
    pool_tokens: dict[str, int] = field(default_factory=dict)
    kv_scales: Any = None  # an fp8 target pool's ``KVScales`` (its ``source``: "checkpoint" or "1.0"); else None


@dataclass(frozen=True)
class Warmup:
    """Optional stage ``warmup``: what was captured before the executor starts (CUDA graphs).

    A skipped warmup is ``Warmup()``: nothing captured, the executor runs every step eagerly.
    ``graph_bytes`` is measured (device memory in use after the capture less before it);
    ``reserved_bytes`` is what the capacity plan set aside for it, from the profile.
    """

    handle: Any = None  # the backend's captured state (native: the ModelRunner holding the graphs)
    batch_sizes: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()  # block-table widths (blocks) captured per batch size
    num_graphs: int = 0
    graph_bytes: int = 0
    reserved_bytes: int = 0
    capture_s: float = 0.0


@dataclass(frozen=True)
class WeightsPlan:
    """A live weights update checked from the new files' headers, nothing read yet: where each
    tensor goes in the serving model's parameters (``handle``), and the bytes to read."""

    handle: Any
    path: str
    nbytes: int


@dataclass(frozen=True)
class HostWeights:
    """A sleeping model's weights in host memory (level 1): ``handle`` restores them."""

    handle: Any
    nbytes: int
    pinned: bool


@dataclass(frozen=True)
class RoomCheck:
    """A wake's look at free device memory against what its plan needs; ``plan``: a smaller plan
    when less is free than it needs, else None (the plan stands)."""

    free_bytes: int
    needed_bytes: int
    plan: Any = None
