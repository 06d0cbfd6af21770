"""A live executor's operations: ``swap``, ``update_weights``, ``sleep`` and ``wake``.

Each is one root span (``bootstrap.swap``, ``.weights``, ``.sleep``, ``.wake``) over the stage
spans it runs: graph stages rewound and run again, and one-off stages (``bootstrap.stages.operation``).
An operation first checks what it was given while the model keeps serving; a refusal
(``Refused``) changes nothing. Then ``drain`` (the caller's: a server lets requests in flight
finish) and the old state's release, then the rest. A stage that fails from there raises
``StageFailed`` and ``resume`` (``Bootstrap.retry``) continues from that step. One operation or
build at a time: another is refused at once with ``Busy``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from bootstrap.api.operation_terms import (
    OPERATION_NAMES,
    SAME_IN_A_SWAP,
    Busy,
    OperationRecord,
    OtherRanks,
    Refused,
    Reverted,
    running,
)
from bootstrap.backends.base import Executor, Sleeps
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline import PipelineClosed, StageFailed
from bootstrap.pipeline.collective import failure_of
from bootstrap.pipeline.runner import cause_text
from bootstrap.pipeline.telemetry import operation_span
from bootstrap.stages import operation as live

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from bootstrap.backends.artifacts import HostWeights
    from bootstrap.backends.base import Backend
    from bootstrap.pipeline import Pipeline
    from bootstrap.pipeline.events import EventHub

Drain = Callable[[], Awaitable[None]]
Step = Callable[[Span], Awaitable[None]]
AFTER_WEIGHTS = ("final_build", "warmup", "scheduler_sampler")  # what holds the KV pool, graphs and executor


async def _no_drain() -> None:
    return None


class Operations:
    """The operations of ``Bootstrap`` (its mixin): the state they share and their steps."""

    # what ``Bootstrap`` holds and defines, declared here for the steps below
    config: BootstrapConfig
    backend: Backend
    pipeline: Pipeline
    hub: EventHub
    tracer: Tracer
    executor: Executor | None  # a property of ``Bootstrap``
    new_pipeline: Callable[..., Pipeline]
    forget_spans: Callable[[], None]

    def __init__(self, ranks: OtherRanks | None = None) -> None:
        self.ranks = ranks
        self.operations: list[OperationRecord] = []
        self.asleep = 0  # the level slept at; 0 awake
        self.busy: str | None = None  # the build or operation running
        self.resumable: tuple[str, list[Step]] | None = None  # a failed operation's steps left
        self._host: HostWeights | None = None  # level 1's host copy, its buffers kept for the next sleep
        self._weights_path: str | None = None  # the last update's, read again after a level-2 wake
        self._scope: anyio.CancelScope | None = None
        self._next: Pipeline | None = None  # a swap's new pipeline until it replaces the current one
        self._ended = anyio.Event()  # set when the operation in progress has unwound

    # ---- the operations ------------------------------------------------------------------------

    async def swap(self, config: BootstrapConfig, *, drain: Drain = _no_drain) -> Executor:
        """Serve ``config`` (only ``MODEL_FIELDS`` may change): its source checked by
        ``resolve_classes`` (counting the serving model's memory as free) and its files' headers
        (``check_checkpoint``) while the old model serves; then ``drain``, the old pipeline
        released, the new one's stages run. A new model that cannot be read even so (a
        ``ConfigError`` from its stages: a NaN weight) brings the old one back (``Reverted``)."""
        for field in SAME_IN_A_SWAP:
            if getattr(config, field) != getattr(self.config, field):
                raise Refused(
                    f"{field}: a live server keeps its {getattr(self.config, field)!r}; "
                    f"start another server for {getattr(config, field)!r}"
                )
        new: Pipeline | None = None

        async def check(span: Span) -> None:
            nonlocal new
            new = self._next = self.new_pipeline(config, releasable_bytes=self._held_bytes())
            try:
                await new.run(upto="resolve_classes", span=span)
                known = new.artifacts
                await new.run_stage(live.CHECK_CHECKPOINT, {n: known[n] for n in live.CHECK_CHECKPOINT.requires}, span)
            except BaseException:
                await self._close_next()
                raise

        serving = self.executor is not None or bool(self.asleep)  # an old model to bring back
        before, weights_path = self.config, self._weights_path

        async def release(span: Span) -> None:
            with self._timed("drain"):
                await self._drain(drain)
            old, self.pipeline, self._next = self.pipeline, new, None
            self.config, self.asleep, self._host, self._weights_path = config, 0, None, None
            with self._timed("release"):
                await self._close(old)

        async def build(span: Span) -> None:
            try:
                await self.pipeline.run(span=span)
            except StageFailed as exc:
                if not serving or not isinstance(failure_of(exc.cause), ConfigError):
                    raise  # the server fails; a retry resumes the new model's stages
                await self._bring_back(before, weights_path, span)
                raise Reverted(
                    f"swap failed at {exc.stage}: {cause_text(exc.cause)}; {before.model} serves again"
                ) from exc

        return await self._operate(("swap", (config,)), f"model={config.model}", check, [release, build])

    async def update_weights(self, path: str | Any, *, drain: Drain = _no_drain) -> Executor:
        """Read the checkpoint at ``path`` (same architecture and shapes, checked from its
        headers first) into the serving model's parameters in place; the KV is dropped with the
        executor, the CUDA graphs stay valid (same addresses)."""
        self._check_serving("update weights")
        path = str(path)
        plan: Any = None

        async def check(span: Span) -> None:
            nonlocal plan
            plan = await self._one(live.CHECK_WEIGHTS, span, path=path)

        async def stop(span: Span) -> None:
            with self._timed("drain"):
                await self._drain(drain)
            with self._timed("release"):
                await self.pipeline.rewind(["scheduler_sampler"])

        async def read(span: Span) -> None:
            await self._one(live.READ_WEIGHTS, span, weights_plan=plan)
            self._weights_path = path

        return await self._operate(("update_weights", (path,)), f"path={path}", check, [stop, read, self._build_rest])

    async def sleep(self, level: int, *, drain: Drain = _no_drain) -> None:
        """Give the device back: level 1 keeps the weights in host memory (page-locked on
        CUDA), level 2 drops them (``wake`` reads them from the source again). The KV pool, the
        CUDA graphs and the executor go at both levels."""
        if level not in (1, 2) or isinstance(level, bool):
            raise Refused(f"level: {level!r} is not a sleep level; allowed: 1 (weights to host memory), 2 (dropped)")
        if level == 1 and not isinstance(self.backend, Sleeps):
            raise Refused(f"level: the {self.backend.name} backend cannot keep weights in host memory; allowed: 2")
        self._check_serving("sleep")

        async def release(span: Span) -> None:
            with self._timed("drain"):
                await self._drain(drain)
            dropped = ("load_model",) if level == 2 else ()
            if level == 2:  # first: a host copy holds the parameters, whose device memory must go now
                self._host = None
            with self._timed("release"):
                await self.pipeline.rewind([s for s in dropped + AFTER_WEIGHTS if s in self._stage_ids()])
            if level == 2:
                self.asleep = 2

        async def offload(span: Span) -> None:
            self._host = await self._one(live.OFFLOAD_WEIGHTS, span, host_weights=self._host)
            self.asleep = 1

        steps = [release, offload] if level == 1 else [release]
        await self._operate(("sleep", (level,)), f"level={level}", None, steps)

    async def wake(self) -> Executor:
        """The weights back (level 1: from host memory; 2: read from the source again, and a
        weights update's files after them), the room checked (less free than planned: a smaller
        KV pool, never an OOM later), then the pool, graphs and executor built again."""
        if self.busy is not None:
            raise Busy(f"cannot wake while the {running(self.busy)} runs")
        if not self.asleep:
            raise Busy("nothing to wake: the executor is not asleep")

        async def restore(span: Span) -> None:
            if self.asleep == 1:
                await self._one(live.RESTORE_WEIGHTS, span, host_weights=self._host)
            else:
                await self._reload(self._weights_path, span)
            self.asleep = 0

        async def room(span: Span) -> None:
            checked = await self._one(live.CHECK_ROOM, span)
            if checked.plan is not None:
                await self.pipeline.rewind(["budget_split"], replace={"plan": checked.plan})

        return await self._operate(("wake", ()), f"level={self.asleep}", None, [restore, room, self._build_rest])

    async def resume(self) -> Executor | None:
        """Continue a failed operation from its failed step (``Bootstrap.retry``)."""
        if self.resumable is None:
            raise Busy("no operation to resume")
        name, steps = self.resumable
        return await self._operate(("resume", ()), "resumed", None, steps, resuming=name)

    # ---- running them --------------------------------------------------------------------------

    @contextlib.contextmanager
    def claim(self, what: str) -> Iterator[None]:
        """Hold the Bootstrap for ``what`` (a build, a retry, an operation), checked and taken with
        no await between; ``Busy`` while another holds it."""
        if self.busy is not None:
            raise Busy(f"cannot {what}: the {running(self.busy)} is still running")
        self.busy = what
        try:
            yield
        finally:
            self.busy = None

    async def close_operations(self) -> None:
        """Cancel an operation in progress (``aclose``) and wait for it to unwind; its steps roll
        back what they began. A swap's new pipeline that never replaced the current one is closed."""
        if self._scope is not None:
            self._scope.cancel()
            await self._ended.wait()
        await self._close_next()

    @contextlib.contextmanager
    def told(self, method: str, args: tuple[Any, ...]) -> Iterator[None]:
        """The other ranks (if any) run ``method(*args)`` while the block runs here."""
        if self.ranks is None:
            yield
            return
        self.ranks.begin(method, args)
        try:
            yield
        finally:
            self.ranks.done()

    async def _drain(self, drain: Drain) -> None:
        await drain()
        if self.ranks is not None:
            self.ranks.drained()

    async def _close_next(self) -> None:
        if self._next is not None:
            next_pipeline, self._next = self._next, None
            await next_pipeline.aclose()

    async def _operate(
        self, call: tuple[str, tuple[Any, ...]], detail: str, check: Step | None, steps: list[Step], resuming: str = ""
    ) -> Executor | None:
        """Run the operation ``call`` (the method and its arguments, as the other ranks run it);
        ``resuming``: the name of the failed operation whose ``steps`` are left."""
        name = resuming or OPERATION_NAMES[call[0]]
        with self.claim(name), self.told(*call):
            if not resuming:  # a new operation: what a failed swap left unadopted goes
                await self._close_next()
            self.forget_spans()
            record = OperationRecord(name, detail, time.time())
            self.operations.append(record)
            began, self._ended = time.monotonic(), anyio.Event()
            with self.tracer.start_as_current_span(operation_span(name), context=Context()) as span:
                span.set_attribute("bootstrap.operation.detail", detail)
                try:
                    with anyio.CancelScope() as self._scope:
                        await self._run_steps(record, check, steps, span)
                    if self._scope.cancelled_caught:  # by close_operations
                        raise PipelineClosed(f"the {name} was cancelled: the Bootstrap is closing")
                except BaseException as exc:
                    _record(record, span, exc)
                    raise
                finally:
                    self._scope = None
                    self._ended.set()
                    record.duration_s = round(time.monotonic() - began, 6)
                record.outcome = "ok"
                span.set_attribute("bootstrap.outcome", "ok")
                span.set_status(Status(StatusCode.OK))
        return self.executor if not self.asleep else None

    async def _run_steps(self, record: OperationRecord, check: Step | None, steps: list[Step], span: Span) -> None:
        self.resumable = None
        if check is not None:
            try:
                await check(span)
            except StageFailed as exc:
                raise Refused(f"{record.name} refused at {exc.stage}: {cause_text(exc.cause)}") from exc
        for index, step in enumerate(steps):
            try:
                await step(span)
            except Reverted:
                raise  # the old state is back: nothing to resume
            except BaseException:
                self.resumable = (record.name, steps[index:])
                raise

    @contextlib.contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        """A part of the operation that is no stage (``drain``, ``release``): a child span
        ``bootstrap.<part>`` and its seconds in the record."""
        began = time.monotonic()
        with self.tracer.start_as_current_span(f"bootstrap.{part}"):
            yield
        setattr(self.operations[-1], f"{part}_s", round(time.monotonic() - began, 6))

    async def _build_rest(self, span: Span) -> None:
        await self.pipeline.run(span=span)

    async def _reload(self, weights_path: str | None, span: Span) -> None:
        """The model read from its source again (``load_model``), and a weights update's files after it."""
        await self.pipeline.run(upto="load_model", span=span)
        if weights_path is not None:
            plan = await self._one(live.CHECK_WEIGHTS, span, path=weights_path)
            await self._one(live.READ_WEIGHTS, span, weights_plan=plan)
        self._weights_path = weights_path

    async def _bring_back(self, config: BootstrapConfig, weights_path: str | None, span: Span) -> None:
        """After a swap's new model failed to load: it is released and the model of ``config``
        served again, its weights read from its files again (from the page cache where it holds
        them) and its plan from the plan cache (its stages skipped where the plan is cached)."""
        failed, self.pipeline, self.config = self.pipeline, self.new_pipeline(config), config
        await self._close(failed)
        await self._reload(weights_path, span)
        await self.pipeline.run(span=span)

    @staticmethod
    async def _close(pipeline: Pipeline) -> None:
        await pipeline.rewind([s.id for s in pipeline.stages])  # each artifact dropped as it is released
        await pipeline.aclose()

    async def _one(self, stage: Any, span: Span, **given: Any) -> Any:
        """A one-off stage of ``bootstrap.stages.operation``: its inputs from the pipeline's artifacts,
        ``given`` over them."""
        known = {**self.pipeline.artifacts, **given}
        return await self.pipeline.run_stage(stage, {name: known[name] for name in stage.requires}, span)

    def _check_serving(self, what: str) -> None:
        if self.busy is not None:
            raise Busy(f"cannot {what}: the {running(self.busy)} is still running")
        if self.asleep:
            raise Busy(f"cannot {what}: the executor is asleep (level {self.asleep}); wake it first")
        if self.executor is None:
            raise Busy(f"cannot {what}: no executor is serving (idle, failed or not built yet)")

    def _stage_ids(self) -> set[str]:
        return {s.id for s in self.pipeline.stages}

    def _held_bytes(self) -> int:
        """Device bytes the serving model gives back when released: weights, KV pools, graphs."""
        if self.asleep:
            return 0
        artifacts = self.pipeline.artifacts
        held = getattr(artifacts.get("loaded"), "weight_bytes", 0)
        held += sum(getattr(artifacts.get("final"), "pool_bytes", {}).values())
        return held + getattr(artifacts.get("warmup"), "graph_bytes", 0)


def _record(record: OperationRecord, span: Span, exc: BaseException) -> None:
    cancelled = isinstance(exc, anyio.get_cancelled_exc_class() | PipelineClosed)
    record.outcome = "refused" if isinstance(exc, Refused | ConfigError) else "cancelled" if cancelled else "failed"
    record.error = str(exc) or type(exc).__name__
    span.set_attribute("bootstrap.outcome", record.outcome)
    if isinstance(exc, StageFailed):
        span.set_attribute("bootstrap.failed_stage", exc.stage)
    span.set_status(Status(StatusCode.ERROR, record.error))
