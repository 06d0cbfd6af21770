"""``Bootstrap``: one model's executor built through the stages, and every later change of it.

A start runs the stages (``build``); a failed one raises ``StageFailed`` and keeps every earlier
artifact, so ``retry`` resumes without reloading the weights; ``aclose`` releases everything.
A live server changes the model without a new process (``swap``, ``update_weights``,
``sleep``, ``wake``: ``bootstrap.api.operations``, ``docs/serving.md#live-operations``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from bootstrap.api.factory import default_backend, make_pipeline
from bootstrap.api.operation_terms import Busy, OtherRanks
from bootstrap.api.operations import Operations
from bootstrap.backends.base import Backend, Executor
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import Pipeline
from bootstrap.pipeline.events import EventHub, StageEvent, StageStatus
from bootstrap.pipeline.process import ProcessTimeline
from bootstrap.pipeline.report import stage_rows
from bootstrap.pipeline.telemetry import TRACER_NAME, is_root_span, make_tracer_provider
from bootstrap.stages.summary import plan_summary


@dataclass(frozen=True)
class BootstrapReport:
    """What a build or operation did: one row per stage, the KV plan, the trace id, the time."""

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


class Bootstrap(Operations):
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
        ranks: OtherRanks | None = None,
        forward_spans: SpanExporter | None = None,
    ) -> None:
        """``process``: the command's timeline (``bootstrap.pipeline.process``); its spans, the
        backend's creation among them, go to the same trace as the stages'. ``traces_requests``:
        a server will trace its requests with ``tracer`` (their spans reach the file in batches).
        ``ranks``: the other ranks, which run each operation and retry with this one.
        ``forward_spans``: gets every span but the requests' (the engine's process: the server's file)."""
        self.config = config
        self.process = process
        self._spans = InMemorySpanExporter()
        self._provider = make_tracer_provider(
            trace_file=trace_file, otlp=otlp, memory=self._spans, requests=traces_requests, forward=forward_spans
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
        self.hub = EventHub()  # every pipeline's events relayed: its subscribers and history see them all
        self.pipeline: Pipeline = self.new_pipeline(config)
        self._started: float | None = None
        self._ready_s: float | None = None
        super().__init__(ranks)

    def new_pipeline(self, config: BootstrapConfig, releasable_bytes: int = 0) -> Pipeline:
        return make_pipeline(
            config, self.backend, tracer_provider=self._provider, relay=self.hub, releasable_bytes=releasable_bytes
        )

    @functools.cached_property
    def tracer(self) -> Tracer:
        """A tracer of this build's trace pipeline (its file and OTLP): the server's request
        spans go there, and stay out of the build's report. Made once: a server asks per request."""
        return self._provider.get_tracer(TRACER_NAME)

    @property
    def executor(self) -> Executor | None:
        """The started executor, None while none is (idle, asleep, failed, or not built yet)."""
        done = all(self.pipeline.status[s.id].state in ("done", "skipped") for s in self.pipeline.stages)
        return self.pipeline.artifacts.get("executor") if done else None

    def stage_status(self) -> list[StageStatus]:
        """The current pipeline's stages as they stand (``GET /v1/bootstrap``, ``/metrics``)."""
        return list(self.pipeline.status.values())

    def plan(self) -> dict[str, Any]:
        """The plan the current pipeline's artifacts make (``stages.summary``)."""
        return plan_summary(self.pipeline.artifacts)

    def events(self) -> AsyncIterator[StageEvent]:
        return self.hub.subscribe()

    async def build(self) -> Executor:
        """Run the stages; return the started executor. Raises ``StageFailed``."""
        with self.claim("build"):
            self._started = self._started or time.monotonic()
            with self._in_process():
                artifacts = await self.pipeline.run()
            self._ready_s = time.monotonic() - self._started
            return artifacts["executor"]

    async def retry(self, stage_id: str | None = None) -> Executor:
        """Resume after ``StageFailed`` from the failed stage (or ``stage_id``); the executor.
        After a failed operation, its own steps resume from the failed one."""
        if self.resumable is not None and stage_id is None:
            return await self.resume()
        with self.claim("retry"), self.told("retry", (stage_id,)):
            with self._in_process():
                artifacts = await self.pipeline.retry(stage_id)
            self._ready_s = time.monotonic() - (self._started or time.monotonic())
            return artifacts["executor"]

    def report(self) -> BootstrapReport:
        """The last build's (or, after one, the last operation's) stages and plan."""
        spans = self._spans.get_finished_spans()
        roots = [s for s in spans if is_root_span(s.name)]
        trace_id = roots[-1].get_span_context().trace_id if roots else None
        if self.operations:  # one operation's trace: its own stages only
            spans = [s for s in spans if s.get_span_context().trace_id == trace_id]
        ready = self.operations[-1].duration_s if self.operations else self._ready_s
        hex_id = f"{trace_id:032x}" if trace_id is not None else None
        return BootstrapReport(stage_rows(spans), plan_summary(self.pipeline.artifacts), hex_id, ready)

    def detach(self) -> tuple[Executor, BootstrapReport]:
        """Hand the executor to the caller (see ``Pipeline.detach``) and flush the trace."""
        if self.busy is not None:
            raise Busy(f"cannot detach while the {self.busy} runs")
        report = self.report()
        artifacts = self.pipeline.detach()
        self.hub.close()
        self._end_process()
        self._provider.shutdown()
        return artifacts["executor"], report

    async def aclose(self) -> None:
        """Cancel what runs, shut the executor down and release every pool and the weights (the
        process's ``shutdown`` phase); flush the trace."""
        try:
            with self.phase("shutdown"):
                await self.close_operations()
                await self.pipeline.aclose()
        finally:
            self.hub.close()
            self._end_process()
            self._provider.shutdown()

    def forget_spans(self) -> None:
        """An operation begins: its report holds its own spans, and a long-lived server keeps no others."""
        self._spans.clear()

    def phase(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
        """A phase of the process's timeline around the block (``answer``, ``serving``, ...);
        nothing without a timeline."""
        return self.process.phase(name, **attributes) if self.process is not None else contextlib.nullcontext()

    def _in_process(self) -> contextlib.AbstractContextManager[None]:
        return self.process.current() if self.process is not None else contextlib.nullcontext()

    def _end_process(self) -> None:
        if self.process is not None:
            self.process.end()
