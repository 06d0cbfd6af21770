"""The Python API: build a real, started executor through the stages.

    executor, report = await bootstrap.build_executor(config)   # you own the executor
    async with bootstrap.executor(config) as ex: ...             # released on exit

``Bootstrap`` is the object both (and the CLI and the server) use: one pipeline, its spans and
its report. A failed build raises ``StageFailed`` and keeps every earlier artifact, so
``await boot.retry()`` resumes without reloading the weights; ``aclose`` releases everything.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer, TracerProvider

from bootstrap.backends.base import Backend, Executor, HasCollective, ShutsDownAtExit
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import Pipeline, Stage
from bootstrap.pipeline.events import StageEvent
from bootstrap.pipeline.process import ProcessTimeline
from bootstrap.pipeline.report import stage_rows
from bootstrap.pipeline.telemetry import ROOT_SPAN, TRACER_NAME, MissingExtra, make_tracer_provider
from bootstrap.stages import DEFAULT_STAGES
from bootstrap.stages.plan_cache import PlanCache
from bootstrap.stages.summary import plan_summary


@dataclass(frozen=True)
class BootstrapReport:
    """What a build did: one row per stage, the KV plan, the trace id and the time to ready."""

    stages: list[dict[str, Any]]
    plan: dict[str, Any]
    trace_id: str | None
    time_to_ready_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "plan": self.plan,
            "trace_id": self.trace_id,
            "time_to_ready_s": self.time_to_ready_s,
        }


class Bootstrap:
    """One executor build on ``backend`` (the native engine on ``config.device`` by default)."""

    def __init__(
        self,
        config: BootstrapConfig,
        *,
        backend: Backend | None = None,
        trace_file: Path | None = None,
        otlp: bool = False,
        process: ProcessTimeline | None = None,
        traces_requests: bool = False,
    ) -> None:
        """``process``: the command's timeline (``bootstrap.pipeline.process``); its spans, the
        backend's creation among them, go to the same trace as the stages'. ``traces_requests``:
        a server will trace its requests with ``tracer`` (their spans reach the file in batches)."""
        self.config = config
        self.process = process
        self._spans = InMemorySpanExporter()
        self._provider = make_tracer_provider(
            trace_file=trace_file, otlp=otlp, memory=self._spans, requests=traces_requests
        )
        if process is not None:
            process.attach(self._provider.get_tracer(TRACER_NAME))
        try:
            with self.phase("backend") if backend is None else contextlib.nullcontext():
                self.backend = backend if backend is not None else default_backend(config)
        except BaseException:  # no backend, no Bootstrap: its trace is flushed and closed here
            self._end_process()
            self._provider.shutdown()
            raise
        self.pipeline: Pipeline = make_pipeline(config, self.backend, tracer_provider=self._provider)
        self._started: float | None = None
        self._ready_s: float | None = None

    @functools.cached_property
    def tracer(self) -> Tracer:
        """A tracer of this build's trace pipeline (its file and OTLP): the server's request
        spans go there, and stay out of the build's report. Made once: a server asks per request."""
        return self._provider.get_tracer(TRACER_NAME)

    def events(self) -> AsyncIterator[StageEvent]:
        return self.pipeline.events()

    async def build(self) -> Executor:
        """Run the stages; return the started executor. Raises ``StageFailed``."""
        self._started = self._started or time.monotonic()
        with self._in_process():
            artifacts = await self.pipeline.run()
        self._ready_s = time.monotonic() - self._started
        return artifacts["executor"]

    async def retry(self, stage_id: str | None = None) -> Executor:
        """Resume after ``StageFailed`` from the failed stage (or ``stage_id``); the executor."""
        with self._in_process():
            artifacts = await self.pipeline.retry(stage_id)
        self._ready_s = time.monotonic() - (self._started or time.monotonic())
        return artifacts["executor"]

    def report(self) -> BootstrapReport:
        spans = self._spans.get_finished_spans()
        roots = [s for s in spans if s.name == ROOT_SPAN]
        trace_id = f"{roots[-1].get_span_context().trace_id:032x}" if roots else None
        return BootstrapReport(stage_rows(spans), plan_summary(self.pipeline.artifacts), trace_id, self._ready_s)

    def detach(self) -> tuple[Executor, BootstrapReport]:
        """Hand the executor to the caller (see ``Pipeline.detach``) and flush the trace."""
        report = self.report()
        artifacts = self.pipeline.detach()
        self._end_process()
        self._provider.shutdown()
        return artifacts["executor"], report

    async def aclose(self) -> None:
        """Shut the executor down and release every pool and the weights (the process's
        ``shutdown`` phase); flush the trace."""
        try:
            with self.phase("shutdown"):
                await self.pipeline.aclose()
        finally:
            self._end_process()
            self._provider.shutdown()

    def phase(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
        """A phase of the process's timeline around the block (``answer``, ``serving``, ...);
        nothing without a timeline."""
        return self.process.phase(name, **attributes) if self.process is not None else contextlib.nullcontext()

    def _in_process(self) -> contextlib.AbstractContextManager[None]:
        return self.process.current() if self.process is not None else contextlib.nullcontext()

    def _end_process(self) -> None:
        if self.process is not None:
            self.process.end()


def make_pipeline(
    config: BootstrapConfig,
    backend: Backend,
    *,
    tracer_provider: TracerProvider | None = None,
    stages: Sequence[Stage] = DEFAULT_STAGES,
) -> Pipeline:
    """On several ranks (a backend with a ``collective``), every attempt is agreed across them
    and the plan cache is off: one rank's cache hit must not skip a stage its peers run. The plan
    cache made here stores the plan once ``capacity`` has succeeded; that stage only computes it."""
    collective = backend.collective if isinstance(backend, HasCollective) else None
    several = collective is not None and collective.world_size > 1
    plan_cache = PlanCache(config.plan_cache) if config.plan_cache and not several else None
    inputs = {"config": config, "backend": backend, "plan_cache": plan_cache}
    has_capacity = any(stage.id == "capacity" for stage in stages)
    after = {"capacity": plan_cache.remember_measured} if plan_cache is not None and has_capacity else {}
    return Pipeline(
        stages, inputs, tracer_provider=tracer_provider, device=backend.device, collective=collective, after=after
    )


def require_engine() -> None:
    """``MissingExtra`` naming the install command when torch is missing (the planner needs none;
    every real backend does)."""
    if find_spec("torch") is None:
        raise MissingExtra(
            "this command runs a real engine, which needs torch: "
            "pip install torch==2.13.0 && pip install -e '.[engine]' (a CUDA build of torch on a GPU)"
        )


def default_backend(config: BootstrapConfig) -> Backend:
    """The backend ``config.backend`` names on ``config.device``; without torch, or ``trtllm``
    without TensorRT-LLM installed, ``MissingExtra`` naming the install command."""
    require_engine()
    from bootstrap.backends.native.backend import NativeBackend  # imports torch: only when asked for
    from bootstrap.backends.native.placement import device_for

    if config.backend == "trtllm":
        from bootstrap.backends.trtllm import create_backend

        return create_backend(device_for(config.device)[0])
    return NativeBackend.for_config(config)


async def build_executor(config: BootstrapConfig, **options: Any) -> tuple[Executor, BootstrapReport]:
    """Build and start an executor; the caller owns it (``executor.shutdown()`` releases its KV
    pool and worker; weights go with the last reference). On failure nothing is left allocated."""
    boot = Bootstrap(config, **options)
    try:
        await boot.build()
    except BaseException:
        await boot.aclose()
        raise
    executor, report = boot.detach()
    shut_down_at_exit(executor)
    return executor, report


def shut_down_at_exit(executor: Executor) -> None:
    """A program that ends without ``shutdown`` must not abort on a worker thread still in a
    torch call as the interpreter finalizes: the native ``PyExecutor`` guards itself (an
    ``atexit`` hook from its worker's start to its ``shutdown``); any other backend's executor
    gets a hook here, holding it weakly so that its weights still go with the last reference."""
    if not (isinstance(executor, ShutsDownAtExit) and executor.shuts_down_at_exit):
        atexit.register(_shut_down_if_running, weakref.ref(executor))


def _shut_down_if_running(ref: weakref.ref[Executor]) -> None:
    executor = ref()
    if executor is not None and executor.is_running:
        executor.shutdown()


@asynccontextmanager
async def executor(config: BootstrapConfig, **options: Any) -> AsyncIterator[Executor]:
    """``async with executor(config) as ex``: a started executor, everything released on exit."""
    boot = Bootstrap(config, **options)
    try:
        yield await boot.build()
    finally:
        await boot.aclose()
