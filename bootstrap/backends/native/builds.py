"""The native backend's handles: what ``load_model`` loaded, and what a probe or final build made."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from bootstrap.engine.executor.py_executor import PyExecutor
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.sources.loader import LoadedWeights


@dataclass(frozen=True)
class NativeModels:
    """``LoadedModel.handle``: the loaded target and draft, and the pool geometry they share."""

    target: LoadedWeights
    draft: LoadedWeights | None
    tokens_per_block: int
    max_seq_len: int

    def by_name(self) -> dict[str, LoadedWeights]:
        return {"target": self.target} | ({"draft": self.draft} if self.draft is not None else {})


@dataclass(frozen=True)
class NativeBuild:
    """Handle of a probe or final build: one pool (and, for probes, one executor) per model."""

    pools: Mapping[str, PagedKVCache]
    executors: Mapping[str, PyExecutor] = dataclasses.field(default_factory=dict)
