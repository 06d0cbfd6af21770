"""The backend protocol: what the stages call, one method per piece of device work.

Stages stay thin: they decide *what* to build (sizes, retries, adaptations) and a backend does
the building. Every method that allocates receives an ``Undo`` and registers, right after each
allocation, the action that releases it; the pipeline runs those actions when an attempt fails
(rollback), when a later stage consumes the artifact, or when the run is cancelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from bootstrap.artifacts import EstimationBuild, FinalBuild, LoadedModel, ResolvedClasses
from bootstrap.budget_split import PoolBudgets
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.config import BootstrapConfig
from bootstrap.devices import Device
from bootstrap.models.shape import ModelShape
from bootstrap.undo import Undo


class Backend(Protocol):
    """Optional, not part of the protocol: ``check_config(config, shape) -> None``, raising
    ``ConfigError`` for what this backend cannot do; ``resolve_classes`` calls it when a backend
    defines it, before any load (the trtllm backend refuses multi-rank and V2 on 1.2.1 there)."""

    name: str
    device: Device
    classes: Mapping[str, str]  # class names chosen for "kv_manager", "scheduler", "sampler"

    def model_shape(self, spec: str) -> ModelShape:
        """The shape of the model ``spec`` names, read from its config alone (no weights)."""

    def default_dtype(self, shape: ModelShape) -> str:
        """The weight dtype ``dtype="auto"`` means on this backend's device."""

    def load_model(self, config: BootstrapConfig, resolved: ResolvedClasses, undo: Undo) -> LoadedModel:
        """Load target (and draft) weights onto ``device``, and the tokenizer."""

    def build_estimation(
        self, loaded: LoadedModel, resolved: ResolvedClasses, probe_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> EstimationBuild:
        """Allocate probe KV pools of ``probe_tokens`` tokens and a temporary executor on them."""

    def profile(
        self, estimation: EstimationBuild, loaded: LoadedModel, max_num_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> MemoryProfile:
        """Run dummy requests filling ``max_num_tokens`` through the probe; measure memory."""

    def build_final(
        self, loaded: LoadedModel, resolved: ResolvedClasses, budgets: PoolBudgets, undo: Undo
    ) -> FinalBuild:
        """Allocate the final KV pools exactly as ``budgets`` says."""

    def start_executor(
        self,
        loaded: LoadedModel,
        resolved: ResolvedClasses,
        final: FinalBuild,
        plan: CapacityPlan,
        config: BootstrapConfig,
        undo: Undo,
    ) -> Any:
        """Create scheduler and sampler, wire and start the executor, serve one smoke request."""
