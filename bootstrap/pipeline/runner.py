"""The stage runner: graph, attempts, rollback, resume, cancellation, events and spans.

``Pipeline(stages, inputs)`` orders the stages by the artifacts they need and provide and runs
each one as soon as its inputs exist, independent ones concurrently. Each stage attempt gets a
span and an ``Undo``; a retryable failure runs the undo (rollback), lets the stage ``adapt`` its
inputs, and tries again under the stage's tenacity policy. A stage that gives up raises
``StageFailed``; every artifact made so far is kept, and ``retry()`` resumes from there.
Cancelling ``run()`` releases every completed stage, newest first; so does ``aclose()`` during a
run, which then raises ``PipelineClosed``. One run at a time: ``run()``, ``retry()`` and
``rewind()`` claim the pipeline before touching any state, and refuse while another holds it.
A live operation (``bootstrap.api.operations``) rewinds some stages and runs them again under
its own root span, and runs one-off stages (``run_stage``) with the same spans and events.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from bootstrap.devices import Device, is_oom
from bootstrap.pipeline.attempts import StageRun
from bootstrap.pipeline.collective import Collective, failure_of
from bootstrap.pipeline.dependencies import check_after, check_graph, topological_order
from bootstrap.pipeline.device_thread import DeviceThread
from bootstrap.pipeline.events import EventHub, StageEvent, StageStatus
from bootstrap.pipeline.stage import GiveUp, Stage, artifact_names
from bootstrap.pipeline.telemetry import ROOT_SPAN, TRACER_NAME
from bootstrap.pipeline.undo import Undo

T = TypeVar("T")


class StageFailed(RuntimeError):
    """A stage gave up. Earlier artifacts are kept; ``Pipeline.retry()`` resumes from ``stage``."""

    def __init__(self, stage: str, attempts: int, cause: BaseException, advice: str = "") -> None:
        self.stage, self.attempts, self.cause, self.advice = stage, attempts, cause, advice
        tries = "attempt" if attempts == 1 else "attempts"
        message = f"stage {stage!r} failed after {attempts} {tries}: {type(cause).__name__}: {cause}"
        super().__init__(f"{message}. {advice}" if advice else message)


def failure_paragraph(exc: StageFailed) -> str:
    """The failure in one paragraph for people (the CLI's stderr, the server's log and
    ``/ready``): the stage, its attempts, the cause, and the advice, if any."""
    tries = "attempt" if exc.attempts == 1 else "attempts"
    text = f"bootstrap failed at stage {exc.stage!r} after {exc.attempts} {tries}: {cause_text(exc.cause)}"
    return f"{text}. {exc.advice}" if exc.advice else text


def cause_text(cause: BaseException) -> str:
    """What ``cause`` says; its type where it says nothing (or ``None``)."""
    text = str(cause).strip()
    return text if text and text != "None" else f"{type(cause).__name__} (no message)"


def cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc``'s causes, nearest first (``raise ... from``, a stage's failure's ``cause``)."""
    found: list[BaseException] = []
    inner = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    while inner is not None and inner not in found and len(found) < 16:
        found.append(inner)
        inner = getattr(inner, "cause", None) or inner.__cause__ or inner.__context__
    return found


class PipelineClosed(RuntimeError):
    """``aclose()`` was called while ``run()`` or ``retry()`` was in progress: the run was
    cancelled and every completed stage rolled back; nothing it built is usable."""


class Pipeline:
    def __init__(
        self,
        stages: Sequence[Stage],
        inputs: Mapping[str, Any],
        *,
        tracer_provider: trace.TracerProvider | None = None,
        device: Device | None = None,
        thread: DeviceThread | None = None,
        collective: Collective | None = None,
        after: Mapping[str, Callable[..., None]] | None = None,
        relay: EventHub | None = None,
    ) -> None:
        """``after``: stage id -> a function run once that stage has its artifact (ran or was
        skipped), inside the stage's span, before its consumed artifacts are released; it names
        what it needs of the stage's inputs and artifact by parameter, as a stage does. The owner
        of an input acts there on a stage's result, and the stage stays pure (the plan cache
        stores a plan after ``capacity``). What it raises fails the stage. ``relay``: a hub that
        gets every event too (a ``Bootstrap``'s, across its pipelines); this pipeline's table is its own."""
        check_graph(stages, inputs.keys())
        check_after(stages, after or {})
        self.stages = topological_order(stages)
        self._after = dict(after or {})
        self.artifacts: dict[str, Any] = dict(inputs)
        self.device = device
        self.collective = collective  # several ranks: every attempt's outcome is agreed (bootstrap.pipeline.collective)
        self.hub = EventHub([s.id for s in self.stages], relay=relay)
        self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)
        self._thread = thread or DeviceThread()
        self._owns_thread = thread is None
        self._undos: dict[str, Undo] = {}  # completed stage -> releases of its artifact
        self._finished: list[str] = []  # completion order, for reverse release
        self._ready: dict[str, anyio.Event] = {}
        self._running = False
        self._closed = False
        self._closing = anyio.Lock()  # aclose() calls wait for each other
        self._idle = anyio.Event()  # set when the current run() or retry() has ended
        self._run_scope: anyio.CancelScope | None = None  # the current run's, for aclose() to cancel

    # -- public API ------------------------------------------------------------------------

    @property
    def status(self) -> dict[str, StageStatus]:
        return self.hub.status

    def events(self) -> AsyncIterator[StageEvent]:
        return self.hub.subscribe()

    async def run(self, *, upto: str | None = None, span: Span | None = None) -> dict[str, Any]:
        """Run every stage not yet done (``upto``: only that stage and those it depends on);
        return all artifacts. ``span``: the root span to run under (an operation's), else one
        ``bootstrap.pipeline`` span of its own.

        Raises ``StageFailed``; ``PipelineClosed`` when ``aclose()`` comes before it returns;
        ``RuntimeError`` at once, touching nothing, when the pipeline is closed or already running.
        """
        if upto is not None:
            self._check_stage_id(upto)
        return await self._exclusively(self._run_pending, upto, span)

    async def _run_pending(self, upto: str | None = None, span: Span | None = None) -> dict[str, Any]:
        wanted = self._upstream(upto) if upto is not None else {s.id for s in self.stages}
        pending = [s for s in self.stages if s.id in wanted and self.status[s.id].state not in ("done", "skipped")]
        await self._run_traced(pending, span)
        return self.artifacts

    async def _run_traced(self, pending: list[Stage], span: Span | None = None) -> None:
        opened = contextlib.nullcontext(span) if span is not None else self._tracer.start_as_current_span(ROOT_SPAN)
        with opened as root:
            root.set_attribute("bootstrap.stages", [s.id for s in pending])
            try:
                await self._run_graph(pending, root)
            except BaseException as exc:
                await self._on_abort(exc, root)
                failure = self._unwrap(exc)
                if failure is exc:
                    raise
                # out of the task group's exception group; its cause is kept (B904: `from` would replace it)
                raise failure  # noqa: B904
            root.set_attribute("bootstrap.outcome", "ok")
            root.set_status(Status(StatusCode.OK))

    async def retry(self, stage_id: str | None = None, *, span: Span | None = None) -> dict[str, Any]:
        """Resume after ``StageFailed``: rerun the failed stage (or ``stage_id``) and the rest.

        Refused like ``run()``, before any artifact is released or any stage reset.
        """
        if stage_id is not None:
            self._check_stage_id(stage_id)
        return await self._exclusively(self._reset_and_run, stage_id, span)

    async def _reset_and_run(self, stage_id: str | None, span: Span | None = None) -> dict[str, Any]:
        if stage_id is not None:
            with anyio.CancelScope(shield=True):  # a half-done reset would leave stale artifacts
                await self._reset(stage_id)
        return await self._run_pending(span=span)

    async def rewind(self, stage_ids: Sequence[str], replace: Mapping[str, Any] | None = None) -> None:
        """Release exactly ``stage_ids``' artifacts (newest first) and make those stages pending,
        keeping every other artifact; then set the artifacts in ``replace`` (an input, or what a
        kept stage made). The next ``run()`` builds the rewound stages again from what is kept:
        the caller names every stage whose artifact would go stale. Refused like ``run()``."""
        for stage_id in stage_ids:
            self._check_stage_id(stage_id)
        await self._exclusively(self._rewind, set(stage_ids), dict(replace or {}))

    async def _rewind(self, stale: set[str], replace: dict[str, Any]) -> None:
        with anyio.CancelScope(shield=True):  # a half-done rewind would leave stale artifacts
            await self._make_pending(stale)
            self.artifacts.update(replace)

    async def run_stage(self, stage: Stage, inputs: Mapping[str, Any], span: Span | None = None) -> Any:
        """Run a stage outside the graph (an operation's own step) with the same span, attempts,
        retries, rollback and events as a graph stage, on this pipeline's device thread; return
        its artifact. Its undo runs after a failed attempt only: a success keeps what it did.
        Raises ``StageFailed``; refused like ``run()``."""
        return await self._exclusively(self._one_stage, stage, inputs, span)

    async def _one_stage(self, stage: Stage, inputs: Mapping[str, Any], span: Span | None) -> Any:
        run = StageRun(stage, inputs, self._tracer, self.hub, self._thread, self.device, self.collective)
        token = otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
        try:
            artifact, _ = await run.execute()
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            advice = stage.oom_advice if is_oom(failure_of(exc)) and not isinstance(exc, GiveUp) else ""
            raise StageFailed(stage.id, run.attempts, exc, advice) from exc
        finally:
            if token is not None:
                otel_context.detach(token)
        return artifact

    def detach(self) -> dict[str, Any]:
        """Hand every artifact of a finished run to the caller, who owns them from now on (an
        executor's ``shutdown`` releases its KV pool; the rest goes with the last reference); stop
        the device thread. Nothing is released here, and the pipeline is closed afterwards."""
        if self._closed or self._running:
            raise RuntimeError(f"this pipeline is {'closed' if self._closed else 'still running'}")
        unfinished = [s.id for s in self.stages if self.status[s.id].state not in ("done", "skipped")]
        if unfinished:
            raise RuntimeError(f"detach needs a finished run; not done: {', '.join(unfinished)}")
        self._closed = True
        self._undos.clear()
        self._finished.clear()
        if self._owns_thread:
            self._thread.close()
        self.hub.close()
        return self.artifacts

    async def aclose(self) -> None:
        """Cancel a run in progress and wait for it to end (it raises ``PipelineClosed``), then
        release every completed stage's artifact, newest first, and stop the device thread.

        Safe to call twice or concurrently: every call returns once everything is released.
        """
        self._closed = True  # before any await: no run can start from here on
        with anyio.CancelScope(shield=True):
            async with self._closing:
                if self._running and self._run_scope is not None:
                    self._run_scope.cancel()
                    await self._idle.wait()
                await self._release_completed()
                if self._owns_thread:
                    await self._thread.aclose()
                self.hub.close()

    async def _exclusively(self, body: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Claim the pipeline with no await before the claim, so a concurrent ``run``, ``retry``
        or ``aclose`` cannot slip in between the check and the act; run ``body`` in a scope
        ``aclose()`` can cancel."""
        if self._closed or self._running:
            raise RuntimeError(f"this pipeline is {'closed' if self._closed else 'already running'}")
        self._running, self._idle, self._run_scope = True, anyio.Event(), anyio.CancelScope()
        try:
            with self._run_scope:
                result = await body(*args)
        finally:
            self._running = False
            self._idle.set()
        if self._closed:  # cancelled by aclose(), or finished just as it came: not a success
            raise PipelineClosed("the pipeline was closed while running; every completed stage was rolled back")
        return result

    # -- running ---------------------------------------------------------------------------

    async def _run_graph(self, pending: list[Stage], root: Span) -> None:
        self._ready = {s.provides: anyio.Event() for s in pending}
        ctx = trace.set_span_in_context(root)
        async with anyio.create_task_group() as tg:
            for stage in pending:
                tg.start_soon(self._run_when_ready, stage, ctx)

    async def _run_when_ready(self, stage: Stage, ctx: otel_context.Context) -> None:
        for name in stage.requires:
            if name in self._ready:
                await self._ready[name].wait()
        run = StageRun(stage, self._inputs(stage), self._tracer, self.hub, self._thread, self.device, self.collective)
        token = otel_context.attach(ctx)
        try:
            artifact, undo = await run.execute(after_success=lambda artifact: self._after_success(run, artifact))
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            advice = stage.oom_advice if is_oom(failure_of(exc)) and not isinstance(exc, GiveUp) else ""
            raise StageFailed(stage.id, run.attempts, exc, advice) from exc
        finally:
            otel_context.detach(token)
        await self._complete(stage, artifact, undo)

    def _inputs(self, stage: Stage) -> dict[str, Any]:
        return {name: self.artifacts[name] for name in stage.requires}

    async def _complete(self, stage: Stage, artifact: Any, undo: Undo) -> None:
        self.artifacts[stage.provides] = artifact
        self._undos[stage.id] = undo
        self._finished.append(stage.id)
        self._ready[stage.provides].set()

    async def _after_success(self, run: StageRun, artifact: Any) -> None:
        if (after := self._after.get(run.stage.id)) is not None:
            known = {**run.inputs, run.stage.provides: artifact}
            after(**{name: known[name] for name in artifact_names(after)})
        await self._release_consumed(run.stage)

    async def _release_consumed(self, stage: Stage) -> None:
        for name in stage.consumes:
            await self._release(self._producer(name))
            self.artifacts.pop(name, None)

    # -- release and abort -----------------------------------------------------------------

    def _producer(self, artifact: str) -> str | None:
        return next((s.id for s in self.stages if s.provides == artifact), None)

    async def _release(self, stage_id: str | None) -> None:
        undo = self._undos.pop(stage_id, None) if stage_id else None
        if undo is not None and len(undo):
            await self._thread.run(undo.run)

    async def _release_completed(self) -> None:
        while self._finished:
            await self._release(self._finished.pop())

    async def _release_and_forget(self, stage_id: str) -> None:
        """Release a stage's artifact and drop the pipeline's reference to it at once, so what
        it holds (an executor's buffers) is gone before the stages under it release theirs."""
        await self._release(stage_id)
        stage = next(s for s in self.stages if s.id == stage_id)
        if self._producer(stage.provides) == stage_id:
            self.artifacts.pop(stage.provides, None)

    async def _on_abort(self, exc: BaseException, root: Span) -> None:
        failure = self._unwrap(exc)
        cancelled = not isinstance(failure, StageFailed)
        root.set_attribute("bootstrap.outcome", "cancelled" if cancelled else "failed")
        root.set_status(Status(StatusCode.ERROR, str(failure) or type(failure).__name__))
        if isinstance(failure, StageFailed):
            root.set_attribute("bootstrap.failed_stage", failure.stage)
            return  # keep earlier artifacts for retry()
        with anyio.CancelScope(shield=True):
            await self._release_completed()
        for stage in self.stages:
            if self.status[stage.id].state != "cancelled":
                self.hub.publish(StageEvent(stage.id, "cancelled", message="pipeline cancelled; rolled back"))
        self.artifacts = {k: v for k, v in self.artifacts.items() if self._producer(k) is None}

    @staticmethod
    def _unwrap(exc: BaseException) -> BaseException:
        """The first StageFailed inside (nested) exception groups, else the exception itself."""
        while isinstance(exc, BaseExceptionGroup):
            failures = [e for e in exc.exceptions if isinstance(e, StageFailed | BaseExceptionGroup)]
            exc = failures[0] if failures else exc.exceptions[0]
        return exc

    def _upstream(self, stage_id: str) -> set[str]:
        """``stage_id`` and every stage it needs, directly or not."""
        wanted = {stage_id}
        for stage in reversed(self.stages):  # reverse topological order: one pass suffices
            if stage.id in wanted:
                wanted |= {p for p in map(self._producer, stage.requires) if p is not None}
        return wanted

    def _check_stage_id(self, stage_id: str) -> None:
        ids = [s.id for s in self.stages]
        if stage_id not in ids:
            raise ValueError(f"unknown stage {stage_id!r}; stages are: {', '.join(ids)}")

    async def _reset(self, stage_id: str) -> None:
        """Make ``stage_id``, what depends on it, and producers of inputs it lost pending again."""
        stale = self._downstream(stage_id)
        await self._make_pending(stale | self._lost_upstream(stale))

    async def _make_pending(self, stale: set[str]) -> None:
        """Release the completed stages of ``stale``, newest first, each artifact dropped as it
        is released, and make every stage of ``stale`` pending."""
        for sid in [s for s in reversed(self._finished) if s in stale]:
            await self._release_and_forget(sid)
            self._finished.remove(sid)
        for stage in self.stages:
            if stage.id in stale:
                self.artifacts.pop(stage.provides, None)
                self.hub.status[stage.id] = StageStatus(stage.id)

    def _downstream(self, stage_id: str) -> set[str]:
        stale = {stage_id}
        for stage in self.stages:  # topological order: one pass suffices
            if {self._producer(n) for n in stage.requires} & stale:
                stale.add(stage.id)
        return stale

    def _lost_upstream(self, stale: set[str]) -> set[str]:
        """Producers whose artifact a stale stage needs but a consumer already released."""
        lost: set[str] = set()
        for stage in reversed(self.stages):
            if stage.id not in stale | lost:
                continue
            for name in stage.requires:
                producer = self._producer(name)
                if producer and name not in self.artifacts:
                    lost.add(producer)
        return lost
