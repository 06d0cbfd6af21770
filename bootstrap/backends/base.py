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

    def check_config(self, config: BootstrapConfig, shape: ModelShape) -> None:
        """Raise ``ConfigError`` for what this backend cannot run (before any weight is loaded)."""

    def kv_caps(self, resolved: ResolvedClasses, config: BootstrapConfig) -> Mapping[str, int]:
        """Caps on the KV budget in bytes beyond the config's, by the name ``limited_by`` shows."""

    def default_headroom_bytes(
        self, profile: MemoryProfile, resolved: ResolvedClasses, config: BootstrapConfig
    ) -> int | None:
        """Bytes to keep free beyond the measured peak when the config sets no memory rule (neither
        ``free_gpu_memory_fraction`` nor ``kv_headroom_bytes``): what this backend's executor can
        need on top of the profile under its worst admitted load, so the KV cache gets the rest.
        None: no such bound is known, and TensorRT-LLM's rule applies (``free_gpu_memory_fraction``
        0.9 of the memory left after the peak)."""

    def load_model(self, config: BootstrapConfig, resolved: ResolvedClasses, undo: Undo) -> LoadedModel:
        """Load target (and draft) weights onto ``device``, and the tokenizer."""

    def estimation_overhead_bytes(self, resolved: ResolvedClasses, config: BootstrapConfig) -> int:
        """Device bytes ``build_estimation`` will allocate *besides* the probe KV pools, for this
        ``config``: the temporary executor's sampler buffers, block tables, sequence slots, and
        any workspace it takes before the dummy requests run. Must not allocate anything.

        The stages call it before every probe build (and every rebuild after an OOM) and cap the
        probe to ``free_gpu_memory_fraction * (free - overhead)`` of the probe's cost, so probe
        and executor fit together (TensorRT-LLM reads its free memory after its sampler exists).
        Over-estimating is safe: the probe is added back to the KV budget, so only the probe
        shrinks. Under-estimating risks an OOM in ``estimation_build``. Memory the dummy forward
        takes (activations, lazily captured graphs) is measured by ``profile``; leave it out.
        """

    def build_estimation(
        self, loaded: LoadedModel, resolved: ResolvedClasses, probe_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> EstimationBuild:
        """Allocate probe KV pools of ``probe_tokens`` tokens (every layer holds every probe token:
        ``bootstrap.capacity.probe_cost``) and a temporary executor on them, whose state is what
        ``estimation_overhead_bytes`` reported. May be called again after its undo ran (a smaller
        rebuild after a profiling OOM)."""

    def profile(
        self, estimation: EstimationBuild, loaded: LoadedModel, max_num_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> MemoryProfile:
        """Run dummy requests filling ``max_num_tokens`` through the probe; measure memory."""

    def build_final(
        self, loaded: LoadedModel, resolved: ResolvedClasses, budgets: PoolBudgets, undo: Undo
    ) -> FinalBuild:
        """Allocate the final KV pools exactly as ``budgets`` says."""

    # Optional, not part of the protocol: ``capture_graphs(loaded, resolved, final, plan, config,
    # batch_sizes, undo) -> Warmup`` for the ``warmup`` stage (skipped, reason ``unsupported``, on a
    # backend without it), and then ``start_executor(..., warmup=)`` receives what it captured. Its
    # memory must be in ``MemoryProfile.graph_bytes`` (measured by ``profile``), which the plan reserves.

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
