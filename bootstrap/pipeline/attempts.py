"""One stage's run: its span, its attempts under tenacity, rollback and adaptation between them."""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import anyio
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential, wait_none

from bootstrap.devices import Device
from bootstrap.pipeline.collective import Collective, RankFailed, SingleRank, agree_attempt, failure_of, is_retryable
from bootstrap.pipeline.device_thread import DeviceThread
from bootstrap.pipeline.events import EventHub, StageEvent
from bootstrap.pipeline.stage import Skip, Stage
from bootstrap.pipeline.telemetry import attempt_span, stage_span
from bootstrap.pipeline.undo import Undo

RANK_SECONDS = "bootstrap.collective.rank_seconds"  # "0.512 0.530": each rank's attempt, by rank


class StageRun:
    def __init__(
        self,
        stage: Stage,
        inputs: Mapping[str, Any],
        tracer: Tracer,
        hub: EventHub,
        thread: DeviceThread,
        device: Device | None,
        collective: Collective | None = None,
    ) -> None:
        self.stage, self.inputs = stage, dict(inputs)
        self._tracer, self._hub, self._thread, self._device = tracer, hub, thread, device
        self._collective = collective or SingleRank()
        self.attempts = 0
        self._changes: Mapping[str, str] = {}
        self._span: Span | None = None
        self._skip_reason = ""
        self._rank_seconds = ""  # several ranks: each one's seconds in the last agreed attempt

    async def execute(self, after_success: Callable[[Any], Awaitable[None]] | None = None) -> tuple[Any, Undo]:
        """Run the stage to success, skip, or failure (re-raised after the span records it).

        ``after_success``, given the artifact, runs inside the stage span (the pipeline runs what
        follows the stage and releases consumed artifacts there, so the span's free memory after
        includes that release).
        """
        with self._tracer.start_as_current_span(stage_span(self.stage.id), record_exception=False) as span:
            self._span = span
            span.set_attribute("bootstrap.stage", self.stage.id)
            self._record_free(span, "before")
            self._publish("started")
            try:
                artifact, undo, outcome = await self._skip_or_attempts()
                if after_success is not None:
                    with anyio.CancelScope(shield=True):  # a half-done release would leak this undo
                        await after_success(artifact)
            except BaseException as exc:
                self._record_failure(span, exc)
                raise
            finally:
                span.set_attribute("bootstrap.attempts", self.attempts)
                self._record_free(span, "after")
            self._record_success(span, artifact, outcome)
            return artifact, undo

    async def _skip_or_attempts(self) -> tuple[Any, Undo, str]:
        # In a worker thread (with this context: the stage's span), never on the event loop: a
        # skip check reads files (the plan cache).
        skip = await anyio.to_thread.run_sync(partial(self.stage.skip, **self.inputs)) if self.stage.skip else None
        if isinstance(skip, Skip):
            self._span.set_attribute("bootstrap.skip_reason", skip.reason)
            self._skip_reason = skip.reason
            return skip.artifact, Undo(), "skipped"
        artifact, undo = await self._attempts()
        return artifact, undo, "ok"

    async def _attempts(self) -> tuple[Any, Undo]:
        policy = self.stage.retry
        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.attempts),
            wait=wait_exponential(multiplier=policy.backoff_s, max=policy.max_backoff_s)
            if policy.backoff_s
            else wait_none(),
            retry=retry_if_exception(lambda e: isinstance(e, Exception) and is_retryable(e, policy.retry_on)),
            before_sleep=self._before_retry,
            sleep=anyio.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                result = await self._attempt()
        return result

    async def _attempt(self) -> tuple[Any, Undo]:
        self.attempts += 1
        undo = Undo()
        name = attempt_span(self.stage.id)
        with self._tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
            span.set_attribute("bootstrap.stage", self.stage.id)
            span.set_attribute("bootstrap.attempt", self.attempts)
            for key, change in self._changes.items():
                span.set_attribute(f"bootstrap.adapt.{key}", change)
            try:
                began = time.monotonic()
                result = await self._call_or_error(undo)
                artifact = await self._agreed(span, result, time.monotonic() - began)
            except BaseException as exc:
                await self._rollback(span, undo, exc)
                raise
            span.set_attribute("bootstrap.outcome", "ok")
            span.set_status(Status(StatusCode.OK))
        return artifact, undo

    async def _call(self, undo: Undo) -> Any:
        fn = partial(self.stage.fn, **self.inputs, **({"undo": undo} if self.stage.wants_undo else {}))
        if not self.stage.blocking:
            result = fn()
            return await result if inspect.isawaitable(result) else result
        ctx = otel_context.get_current()
        return await self._thread.run(_in_context, ctx, fn)

    async def _call_or_error(self, undo: Undo) -> tuple[Any, BaseException | None]:
        """The attempt's artifact, or the error it raised (cancellation is never caught)."""
        try:
            return await self._call(undo), None
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            if self._collective.world_size == 1:
                raise
            return None, exc

    async def _agreed(self, span: Span, result: tuple[Any, BaseException | None], seconds: float) -> Any:
        """On one rank, the artifact. On several, one collective step (in the device thread, it
        blocks): all ranks succeeded and agree on the artifact, or every rank raises the same
        ``RankFailed``. An event on the stage span records it, with every rank's seconds
        (``RANK_SECONDS``, also a figure of the stage)."""
        artifact, error = result
        if self._collective.world_size == 1:
            return artifact
        timings: list[float | None] = []
        agree = self.stage.agree
        run = partial(agree_attempt, self._collective, self.stage.id, artifact, error, agree, seconds, timings)
        attributes: dict[str, Any] = {
            "bootstrap.collective.world_size": self._collective.world_size,
            "bootstrap.collective.rank": self._collective.rank,
            "bootstrap.attempt": self.attempts,
        }
        try:
            agreed = await self._thread.run(run)
        except RankFailed as exc:
            attributes |= {"bootstrap.collective.outcome": "failed", "bootstrap.collective.failed_rank": exc.rank}
            self._span.add_event("bootstrap.collective.attempt", attributes)
            if exc.rank == self._collective.rank and error is not None:
                raise exc from error
            raise
        except Exception as exc:
            self._span.add_event(
                "bootstrap.collective.attempt", attributes | {"bootstrap.collective.outcome": "unresponsive"}
            )
            raise exc from error
        attributes["bootstrap.collective.outcome"] = "agreed" if self.stage.agree else "ok"
        self._rank_seconds = " ".join(f"{t:.3f}" if t is not None else "?" for t in timings)
        attributes[RANK_SECONDS] = self._rank_seconds
        self._span.add_event("bootstrap.collective.attempt", attributes | self._changed_figures(artifact, agreed))
        return agreed

    def _changed_figures(self, mine: Any, agreed: Any) -> dict[str, Any]:
        """This rank's figures that the agreement changed, as ``<figure>.local``."""
        if self.stage.figures is None or mine is None or agreed is None:
            return {}
        local, common = self.stage.figures(mine), self.stage.figures(agreed)
        return {f"{k}.local": v for k, v in local.items() if common.get(k) != v}

    async def _rollback(self, span: Span, undo: Undo, exc: BaseException) -> None:
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        span.set_attribute("bootstrap.outcome", "cancelled" if cancelled else "failed")
        span.set_attribute("bootstrap.rollback.actions", len(undo))
        _mark_error(span, exc)
        drop_frame_locals(exc)
        with anyio.CancelScope(shield=True):
            errors = await self._thread.run(undo.run)
        if errors:
            span.set_attribute("bootstrap.rollback.errors", [repr(e) for e in errors])
        if not cancelled:
            self._publish("attempt_failed", f"{type(exc).__name__}: {exc}")

    def _before_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        adaptation = self.stage.adapt(failure_of(exc), self.inputs) if self.stage.adapt and exc else None
        self._changes = dict(adaptation.changes) if adaptation else {}
        if adaptation:
            self.inputs = {**self.inputs, **adaptation.inputs}
            self._span.add_event("bootstrap.adapt", {f"bootstrap.adapt.{k}": v for k, v in self._changes.items()})
        note = ", ".join(f"{k}: {v}" for k, v in self._changes.items())
        self._publish("retrying", note or "retrying unchanged")

    def _record_free(self, span: Span, when: str) -> None:
        """Read from the event loop: every Device is safe to query from any thread."""
        if self._device is not None:
            span.set_attribute(f"bootstrap.device.free_bytes.{when}", self._device.free_bytes())

    def _record_success(self, span: Span, artifact: Any, outcome: str) -> None:
        figures = dict(self.stage.figures(artifact)) if self.stage.figures and artifact is not None else {}
        if self._rank_seconds:
            figures[RANK_SECONDS] = self._rank_seconds
        for key, value in figures.items():
            span.set_attribute(key, value)
        span.set_attribute("bootstrap.outcome", outcome)
        span.set_status(Status(StatusCode.OK))
        kind = "skipped" if outcome == "skipped" else "done"
        self._publish(kind, self._skip_reason, figures)

    def _record_failure(self, span: Span, exc: BaseException) -> None:
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        span.set_attribute("bootstrap.outcome", "cancelled" if cancelled else "failed")
        _mark_error(span, exc)
        self._publish("cancelled" if cancelled else "failed", f"{type(exc).__name__}: {exc}")

    def _publish(self, kind: str, message: str = "", figures: Mapping[str, Any] | None = None) -> None:
        self._hub.publish(StageEvent(self.stage.id, kind, self.attempts, message, dict(figures or {})))


def _in_context(ctx: otel_context.Context, fn: Any) -> Any:
    """Run ``fn`` in the device thread under the caller's trace context (for nested spans)."""
    token = otel_context.attach(ctx)
    try:
        return fn()
    finally:
        otel_context.detach(token)


def drop_frame_locals(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames in the traceback of ``exc`` and of its causes.

    A failed attempt's exception outlives it (tenacity keeps it for the next attempt's adaptation,
    ``StageFailed`` for the caller), and so would every tensor its frames hold: after an
    out-of-memory error in a forward, the activations allocated before the failure would still
    take device memory while the retry runs. Clearing keeps each frame's file and line.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # frames still running (this one) are skipped
        exc = exc.__cause__ or exc.__context__


def _mark_error(span: Span, exc: BaseException) -> None:
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.record_exception(exc)
    span.set_attribute("error.type", type(exc).__qualname__)
