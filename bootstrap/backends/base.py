"""The backend protocol (what the stages call, one method per piece of device work) and the
executor contract (what ``start_executor`` returns, and what the CLI and the server call on it).

Stages stay thin: they decide *what* to build (sizes, retries, adaptations), a backend builds.
Every method that allocates receives an ``Undo`` and registers, right after each allocation, the
action that releases it, run when an attempt fails, a later stage consumes it, or the run ends.

Every backend's executor is an ``Executor``: whether it runs, and a shutdown safe to call again.
One that takes requests through this project's API (``PyExecutor``) is a ``RequestExecutor``:
``bootstrap run`` uses these methods alone, never its scheduler or pool, and its ``engine_stats``
from any thread (``serve`` reaches a ``PyExecutor`` through the engine channel instead);
TensorRT-LLM's is an ``Executor`` only. What only some backends or executors offer is a
``Protocol`` of its own (``ChecksWeights``, ``CapturesGraphs``, ``HasCollective``;
``ShutsDownAtExit``, ``Speculates``), checked with ``isinstance`` where decided.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from bootstrap.backends.artifacts import (
    EstimationBuild,
    FinalBuild,
    HostWeights,
    LoadedModel,
    ResolvedClasses,
    Warmup,
    WeightsPlan,
)
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
    from bootstrap.engine.spec.speculator import Speculator
    from bootstrap.pipeline.collective import Collective


class Backend(Protocol):
    """Optional, not part of the protocol: the features below it (``ChecksWeights``,
    ``CapturesGraphs``, ``HasCollective``), each checked once with ``isinstance`` where the
    stages decide on it."""

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


# ---- optional backend features: each checked once, with ``isinstance``, where a stage decides ----


@runtime_checkable
class ChecksWeights(Protocol):
    """A backend that refuses, before any load, weights the device cannot hold (``resolve_classes``)."""

    def check_weights(
        self, config: BootstrapConfig, shapes: list[ModelShape], dtype: str, releasable_bytes: int = 0
    ) -> None:
        """Raise ``ConfigError`` when the weights of ``shapes`` (the target and a draft) in ``dtype``
        cannot fit the device beside what is free and ``releasable_bytes`` (a live swap's old
        model); the native backend: weights it cannot hold end in the kernel's OOM killer."""


@runtime_checkable
class ChecksCheckpoints(Protocol):
    """A backend that checks a model's files without reading its weights (a swap, before its drain)."""

    def check_checkpoints(self, config: BootstrapConfig, resolved: ResolvedClasses) -> None:
        """Raise ``ConfigError`` naming the tensor or field that ``load_model`` would refuse in
        ``config``'s model (and draft) from their headers and config.json alone."""


@runtime_checkable
class TakesWeights(Protocol):
    """A backend that reads new weights into a serving model's parameters (``update_weights``)."""

    def plan_weights(self, loaded: LoadedModel, path: str) -> WeightsPlan:
        """Check ``path``'s safetensors headers against the loaded model (``ConfigError`` naming
        a tensor missing or of another shape), reading no weight."""

    def read_weights(self, plan: WeightsPlan) -> int:
        """Read the planned tensors into the parameters in place; the bytes read."""


@runtime_checkable
class Sleeps(Protocol):
    """A backend whose weights can leave the device and come back (``sleep`` level 1)."""

    def offload_weights(self, loaded: LoadedModel, reuse: HostWeights | None, undo: Undo) -> HostWeights:
        """Every parameter to host memory (``reuse``: an earlier offload's buffers), device
        memory released; ``undo`` brings them back."""

    def restore_weights(self, host: HostWeights) -> int:
        """The parameters back on the device from ``host``; the bytes moved."""


@runtime_checkable
class CapturesGraphs(Protocol):
    """A backend that captures CUDA graphs in the ``warmup`` stage (without it: skipped, ``unsupported``)."""

    def capture_graphs(
        self,
        loaded: LoadedModel,
        resolved: ResolvedClasses,
        final: FinalBuild,
        plan: CapacityPlan,
        config: BootstrapConfig,
        batch_sizes: tuple[int, ...],
        undo: Undo,
    ) -> Warmup:
        """Capture the decode steps for ``batch_sizes``; ``start_executor(..., warmup=)`` then
        receives what it captured. Its memory must be in ``MemoryProfile.graph_bytes`` (measured
        by ``profile``), which the plan reserves."""


@runtime_checkable
class HasCollective(Protocol):
    """A backend that may be one of several ranks: every attempt is agreed through ``collective``."""

    collective: Collective | None  # None: a single process


@runtime_checkable
class Executor(Protocol):
    @property
    def is_running(self) -> bool: ...

    def shutdown(self) -> None: ...


class ClosableEvents(Protocol):
    """One request's events (``stream_async``); ``aclose`` lets go of it before its final one."""

    def __aiter__(self) -> ClosableEvents: ...

    async def __anext__(self) -> StreamEvent: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class RequestExecutor(Executor, Protocol):
    tokenizer: Any

    def enqueue(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, *, cache_salt: str | None = None
    ) -> int:
        """Queue a request from any thread; its id. An impossible one is answered at once with
        an error event (``finish_reason="error"``, ``error`` starting ``request rejected: ``).
        ``cache_salt``: it shares cached prefix blocks only with requests of the same salt; its
        final event and response carry ``cached_tokens``."""

    def enqueue_choices(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        n: int = 1,
        *,
        cache_salt: str | None = None,
    ) -> list[int]:
        """``n`` requests of one prompt, prefilled once; their ids (``PyExecutor.enqueue_choices``)."""

    def cancel(self, request_id: int, *, keep_response: bool = False) -> None:
        """Give the request up (with ``keep_response``: cancel it, its response kept to be
        taken); unknown ids are ignored."""

    def stream_async(self, request_id: int, *, cancel_on_abandon: bool = False) -> ClosableEvents:
        """Its events until the final one; a cancelled wait takes nothing."""

    # ASYNC109: the sync await_response's signature, its timeout (TimeoutError) included, for async callers
    async def await_response_async(
        self,
        request_id: int,
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        cancel_on_abandon: bool = False,
    ) -> Response:
        """Its response; ``KeyError`` once it was released."""

    def engine_stats(self) -> EngineStats:
        """KV blocks, requests running and waiting and the prefix cache's figures, from any
        thread, without waiting."""


# ---- optional executor features ------------------------------------------------------------------


@runtime_checkable
class ShutsDownAtExit(Protocol):
    """An executor that guards its own exit (``shuts_down_at_exit`` true: ``bootstrap.api`` adds no hook)."""

    shuts_down_at_exit: bool


@runtime_checkable
class Speculates(Protocol):
    """An executor that can run a draft model: its ``speculator`` (None without a draft), whose ``stats`` count."""

    speculator: Speculator | None


def require_requests(executor: Executor) -> RequestExecutor:
    """``executor`` as a ``RequestExecutor``, or a ``ConfigError`` naming the backend that built it."""
    if isinstance(executor, RequestExecutor):
        return executor
    raise ConfigError(
        f"backend: its executor ({type(executor).__name__}) takes no requests through bootstrap's "
        "request API; the stages built it and the plan above stands (allowed for prompts: native)"
    )
