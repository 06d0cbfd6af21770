"""``SimBackend``: the backend protocol on a ``FakeDevice``: a simulated GPU, no torch, no compute.

It powers ``bootstrap plan`` (a dry-run capacity planner) and the stage tests. Every byte goes
through ``device.allocate(nbytes, tag)``, tagged with the id of the stage that makes it, so
``device.inject_oom("<stage id>", n)`` fails that stage's next ``n`` allocations:

  load_model/weights, load_model/draft_weights       weights on this rank (``weight_bytes / tp``)
  estimation_build/probe_kv                          probe KV pool (``probe_cost``: every layer, every token)
  estimation_build/workspace                         the temporary executor's sampler + block tables
  profiling/activations                              the forward's peak (``backends.activations``), freed at once
  final_build/kv_target, kv_draft, kv_cross          the final KV pools, as the budgets say
  scheduler_sampler/sampler, scheduler_sampler/block_tables   the started executor's state

Each release goes on the method's ``Undo`` right after its allocation; releases are idempotent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bootstrap.backends.activations import (
    ActivationEstimate,
    activation_peak,
    block_table_bytes,
    sampler_state_bytes,
    weight_dtype_bytes,
)
from bootstrap.backends.artifacts import EstimationBuild, FinalBuild, LoadedModel, ResolvedClasses
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.capacity.presets import resolve_model_shape
from bootstrap.capacity.shape import ModelShape
from bootstrap.capacity.split import PoolBudgets
from bootstrap.config import BootstrapConfig
from bootstrap.devices import FakeDevice
from bootstrap.pipeline.undo import Undo


@dataclass
class SimAllocation:
    """One live allocation on the fake device; ``release`` frees it once (later calls do nothing)."""

    device: FakeDevice
    handle: int
    nbytes: int
    tag: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.device.free(self.handle)


def allocate(device: FakeDevice, nbytes: int, tag: str, undo: Undo) -> SimAllocation:
    """Allocate on ``device`` and push the release on ``undo`` right away."""
    allocation = SimAllocation(device, device.allocate(nbytes, tag), nbytes, tag)
    undo.push(allocation.release)
    return allocation


@dataclass(frozen=True)
class SimModel:
    """``LoadedModel.handle``: what was loaded, and what later stages need to know about it."""

    shape: ModelShape
    draft_shape: ModelShape | None
    dtype_bytes: int
    tp: int
    max_seq_len: int
    weights: SimAllocation
    draft_weights: SimAllocation | None


@dataclass(frozen=True)
class SimBuild:
    """Handle of a probe or final build: its allocations (released through the undo)."""

    allocations: tuple[SimAllocation, ...]
    host_bytes: int = 0


@dataclass
class SimExecutor:
    """A started (simulated) executor: owns its sampler state until ``shutdown``."""

    allocations: tuple[SimAllocation, ...]
    max_batch_size: int
    max_num_tokens: int
    kv_tokens: dict[str, int]
    requests_completed: int = 0
    _running: bool = field(default=True, repr=False)

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "running": self._running,
            "requests_completed": self.requests_completed,
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "kv_tokens": dict(self.kv_tokens),
            "state_bytes": sum(a.nbytes for a in self.allocations),
        }

    def serve_smoke_request(self, prompt_tokens: int, tokens_per_block: int) -> None:
        """Admit one request of ``prompt_tokens`` + 1 generated token (no compute)."""
        if not self._running:
            raise RuntimeError("the simulated executor is shut down")
        need = -(-(prompt_tokens + 1) // tokens_per_block) * tokens_per_block
        if self.kv_tokens.get("target", 0) < need:
            raise RuntimeError(f"smoke request needs {need} KV tokens; the target pool holds {self.kv_tokens}")
        self.requests_completed += 1

    def shutdown(self) -> None:
        self._running = False
        for allocation in reversed(self.allocations):
            allocation.release()


class SimBackend:
    """The backend protocol on a simulated GPU (see the module docstring)."""

    name = "sim"
    kv_manager = "SimKvPool"

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def model_shape(self, spec: str) -> ModelShape:
        return resolve_model_shape(spec)

    def default_dtype(self, shape: ModelShape) -> str:
        """The checkpoint's 16-bit dtype; bfloat16 for float32 or unknown checkpoints (a GPU serves 16-bit)."""
        return shape.torch_dtype if shape.torch_dtype in ("bfloat16", "float16") else "bfloat16"

    def check_config(self, config: BootstrapConfig, shape: ModelShape) -> None:
        """The planner prices every layout it can parse."""

    def kv_caps(self, resolved: ResolvedClasses, config: BootstrapConfig) -> Mapping[str, int]:
        return {}  # a simulated GPU is filled, as TensorRT-LLM fills a real one

    def default_headroom_bytes(
        self, profile: MemoryProfile | None, resolved: ResolvedClasses, config: BootstrapConfig
    ) -> int | None:
        return None  # the planner reproduces TensorRT-LLM's rule

    def load_model(self, config: BootstrapConfig, resolved: ResolvedClasses, undo: Undo) -> LoadedModel:
        dtype_bytes, tp = weight_dtype_bytes(resolved.dtype), config.tensor_parallel_size
        weights = allocate(self.device, rank_weight_bytes(resolved.shape, dtype_bytes, tp), "load_model/weights", undo)
        draft = None
        if resolved.draft_shape is not None:
            nbytes = rank_weight_bytes(resolved.draft_shape, dtype_bytes, tp)
            draft = allocate(self.device, nbytes, "load_model/draft_weights", undo)
        model = SimModel(resolved.shape, resolved.draft_shape, dtype_bytes, tp, resolved.max_seq_len, weights, draft)
        total = weights.nbytes + (draft.nbytes if draft else 0)
        return LoadedModel(handle=model, weight_bytes=total, draft_handle=draft)

    def estimation_overhead_bytes(self, resolved: ResolvedClasses, config: BootstrapConfig) -> int:
        """The temporary executor's state: what ``build_estimation`` allocates before the probe."""
        return executor_state_bytes(resolved, config)

    def build_estimation(
        self, loaded: LoadedModel, resolved: ResolvedClasses, probe_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> EstimationBuild:
        """The temporary executor's state, then a probe pool of exactly ``probe_tokens`` (the
        stage sizes and caps it) priced by ``resolved.probe_cost``: every layer holds every probe token."""
        if probe_tokens < 1:
            raise ValueError(f"probe_tokens must be >= 1, got {probe_tokens}")
        overhead = self.estimation_overhead_bytes(resolved, config)
        workspace = allocate(self.device, overhead, "estimation_build/workspace", undo)
        cost = resolved.probe_cost(tp=config.tensor_parallel_size, max_batch_size=config.max_batch_size)
        nbytes = cost.bytes_for_tokens(probe_tokens)
        probe = allocate(self.device, nbytes, "estimation_build/probe_kv", undo)
        return EstimationBuild(
            handle=SimBuild((workspace, probe)),
            probe_tokens=probe_tokens,
            probe_kv_bytes=probe.nbytes,
            max_num_tokens=config.max_num_tokens,
        )

    def profile(
        self, estimation: EstimationBuild, loaded: LoadedModel, max_num_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> MemoryProfile:
        """Measure as the real backends do: peak reset, one worst-case forward, figures after.

        ``model_bytes`` is what was allocated before the forward less the probe KV (weights plus
        the temporary executor's state), so ``MemoryProfile.activation_bytes`` is the forward's peak.
        """
        device = self.device
        device.empty_cache()
        device.reset_peak()
        before, free_before = device.allocated_bytes(), device.free_bytes()
        forward = allocate(device, self.activations(loaded, max_num_tokens).total, "profiling/activations", undo)
        forward.release()
        device.synchronize()
        return MemoryProfile(
            total_bytes=device.total_bytes(),
            free_before_bytes=free_before,
            model_bytes=before - estimation.probe_kv_bytes,
            torch_peak_bytes=device.peak_bytes(),
            torch_used_bytes=device.allocated_bytes(),
            used_bytes=device.total_bytes() - device.free_bytes(),
            probe_kv_bytes=estimation.probe_kv_bytes,
            max_num_tokens=max_num_tokens,
        )

    def activations(self, loaded: LoadedModel, max_num_tokens: int) -> ActivationEstimate:
        """The larger forward peak of the target and the draft model (they run one after the other)."""
        model: SimModel = loaded.handle
        shapes = [s for s in (model.shape, model.draft_shape) if s is not None]
        estimates = [
            activation_peak(
                s,
                max_num_tokens=max_num_tokens,
                max_seq_len=model.max_seq_len,
                dtype_bytes=model.dtype_bytes,
                tp=model.tp,
            )
            for s in shapes
        ]
        return max(estimates, key=lambda e: e.total)

    def build_final(
        self, loaded: LoadedModel, resolved: ResolvedClasses, budgets: PoolBudgets, undo: Undo
    ) -> FinalBuild:
        pools = budgets.pools()
        allocations = tuple(allocate(self.device, p.gpu_bytes, f"final_build/kv_{p.name}", undo) for p in pools)
        return FinalBuild(
            handle=SimBuild(allocations, host_bytes=sum(p.host_bytes for p in pools)),
            pool_bytes={p.name: p.gpu_bytes for p in pools},
            pool_tokens={p.name: p.tokens for p in pools},
        )

    def start_executor(
        self,
        loaded: LoadedModel,
        resolved: ResolvedClasses,
        final: FinalBuild,
        plan: CapacityPlan,
        config: BootstrapConfig,
        undo: Undo,
    ) -> SimExecutor:
        """Allocate the sampler state and block tables, start, and admit one smoke request."""
        batch, vocab = config.max_batch_size, resolved.shape.vocab_size
        sampler = allocate(self.device, sampler_state_bytes(batch, vocab), "scheduler_sampler/sampler", undo)
        tables = block_table_bytes(batch, resolved.max_seq_len, config.tokens_per_block, len(final.pool_bytes))
        block_tables = allocate(self.device, tables, "scheduler_sampler/block_tables", undo)
        executor = SimExecutor((sampler, block_tables), batch, plan.max_num_tokens, dict(final.pool_tokens))
        undo.push(executor.shutdown)
        executor.serve_smoke_request(prompt_tokens=1, tokens_per_block=config.tokens_per_block)
        return executor


def rank_weight_bytes(shape: ModelShape, dtype_bytes: int, tp: int) -> int:
    """Weights one rank holds: ``ceil(weight_bytes / tp)`` (norms are replicated; they are tiny)."""
    return math.ceil(shape.weight_bytes(dtype_bytes) / tp)


def executor_state_bytes(resolved: ResolvedClasses, config: BootstrapConfig) -> int:
    """What a started executor allocates besides KV: sampler buffers and block tables.

    The probe executor holds the same state, so the profile measures it and the plan leaves
    room for it when the final executor starts.
    """
    pools = 1 + (resolved.draft_cost is not None) + (resolved.cross_cost is not None)
    sampler = sampler_state_bytes(config.max_batch_size, resolved.shape.vocab_size)
    return sampler + block_table_bytes(config.max_batch_size, resolved.max_seq_len, config.tokens_per_block, pools)
