"""The backend protocol (what the stages call, one method per piece of device work) and the
executor contract (what ``start_executor`` returns, and what the CLI and the server call on it).

Stages stay thin: they decide *what* to build (sizes, retries, adaptations) and a backend does
the building. Every method that allocates receives an ``Undo`` and registers, right after each
allocation, the action that releases it; the pipeline runs those actions when an attempt fails
(rollback), when a later stage consumes the artifact, or when the run is cancelled.

Every backend's executor is an ``Executor``: it says whether it runs and shuts down (once or many
times). One that takes requests through this project's API (the native engine's ``PyExecutor``)
is a ``RequestExecutor``: ``bootstrap run`` and ``bootstrap serve`` talk to it through these
methods alone, never through its scheduler or pool, and read its load through ``engine_stats``,
which is safe from any thread (the server reads it on the event loop while the engine's worker
steps). TensorRT-LLM's executor is an ``Executor`` only: ``require_requests`` says so by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from bootstrap.backends.artifacts import EstimationBuild, FinalBuild, LoadedModel, ResolvedClasses
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.capacity.shape import ModelShape
from bootstrap.capacity.split import PoolBudgets
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import Device
from bootstrap.pipeline.undo import Undo

if TYPE_CHECKING:
    from bootstrap.engine.executor.stats import EngineStats
    from bootstrap.engine.request.sequence import Response, StreamEvent
    from bootstrap.engine.sampling.sampler import SamplingParams


class Backend(Protocol):
    """Optional, not part of the protocol: ``check_weights(config, shapes, dtype) -> None``,
    raising ``ConfigError`` when the weights of ``shapes`` (the target and a draft) in ``dtype``
    cannot fit the device; ``resolve_classes`` calls it when a backend defines it, before any
    load (the native backend does: weights it cannot hold end in the kernel's OOM killer)."""

    name: str
    device: Device
    kv_manager: str  # the KV cache manager class its pools are (``ResolvedClasses.kv_manager``)

    def model_shape(self, spec: str) -> ModelShape:
        """The shape of the model ``spec`` names, read from its config alone (no weights)."""

    def default_dtype(self, shape: ModelShape) -> str:
        """The weight dtype ``dtype="auto"`` means on this backend's device."""

    def check_config(self, config: BootstrapConfig, shape: ModelShape) -> None:
        """Raise ``ConfigError`` for what this backend cannot run (before any weight is loaded)."""

    def kv_caps(self, resolved: ResolvedClasses, config: BootstrapConfig) -> Mapping[str, int]:
        """Caps on the KV budget in bytes beyond the config's, by the name ``limited_by`` shows."""

    def default_headroom_bytes(
        self, profile: MemoryProfile | None, resolved: ResolvedClasses, config: BootstrapConfig
    ) -> int | None:
        """Bytes to keep free beyond the measured peak when the config sets no memory rule: what
        this backend's executor can need on top of the profile under its worst admitted load, so
        the KV cache gets the rest; ``profile`` None (before profiling, for the probe cap): the part
        known from the config. None: no bound is known, TensorRT-LLM's fraction applies. The rule
        itself: ``bootstrap.capacity.rules``."""

    def load_model(self, config: BootstrapConfig, resolved: ResolvedClasses, undo: Undo) -> LoadedModel:
        """Load target (and draft) weights onto ``device``, and the tokenizer."""

    def estimation_overhead_bytes(self, resolved: ResolvedClasses, config: BootstrapConfig) -> int:
        """Device bytes ``build_estimation`` will allocate *besides* the probe KV pools, for this
        ``config``: the temporary executor's sampler buffers, block tables, sequence slots, and
        any workspace it takes before the dummy requests run. Must not allocate anything.

        The stages call it before every probe build (and every rebuild after an OOM) and cap the
        probe to the memory rule's share of ``free - overhead`` (``bootstrap.capacity.rules``), so probe
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
    ) -> Executor:
        """Create scheduler and sampler, wire and start the executor, serve one smoke request."""


@runtime_checkable
class Executor(Protocol):
    @property
    def is_running(self) -> bool: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class RequestExecutor(Executor, Protocol):
    tokenizer: Any

    def enqueue(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request from any thread; its id. An impossible one is answered at once with
        an error event (``finish_reason="error"``, ``error`` starting ``request rejected: ``)."""

    def enqueue_choices(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1
    ) -> list[int]:
        """``n`` requests of one prompt, prefilled once; their ids (``PyExecutor.enqueue_choices``)."""

    def cancel(self, request_id: int, *, keep_response: bool = False) -> None:
        """Give the request up (with ``keep_response``: cancel it, its response kept to be
        taken); unknown ids are ignored."""

    def stream_async(self, request_id: int, *, cancel_on_abandon: bool = False) -> AsyncIterator[StreamEvent]:
        """Its events until the final one; a cancelled wait takes nothing."""

    async def await_response_async(
        self, request_id: int, timeout: float | None = None, *, cancel_on_abandon: bool = False
    ) -> Response:
        """Its response; ``KeyError`` once it was released."""

    def engine_stats(self) -> EngineStats:
        """KV blocks and requests running and waiting, from any thread, without waiting."""


def require_requests(executor: Executor) -> RequestExecutor:
    """``executor`` as a ``RequestExecutor``, or a ``ConfigError`` naming the backend that built it."""
    if isinstance(executor, RequestExecutor):
        return executor
    raise ConfigError(
        f"backend: its executor ({type(executor).__name__}) takes no requests through bootstrap's "
        "request API; the stages built it and the plan above stands (allowed for prompts: native)"
    )
