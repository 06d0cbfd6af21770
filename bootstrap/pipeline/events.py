"""Progress: stage events as an async stream, and the per-stage status they add up to.

Every consumer (CLI table, HTTP server, tests) subscribes to its own stream; a slow consumer
never blocks the pipeline (its buffer is unbounded, events are small and few).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import anyio
from anyio.streams.memory import MemoryObjectSendStream

EventKind = Literal["started", "attempt_failed", "retrying", "done", "skipped", "failed", "cancelled"]
StageState = Literal["pending", "running", "done", "skipped", "failed", "cancelled"]

HISTORY_KEPT = 4096  # events a hub keeps: a start has tens, an operation about twenty

_STATE_AFTER: dict[EventKind, StageState] = {
    "started": "running",
    "attempt_failed": "running",
    "retrying": "running",
    "done": "done",
    "skipped": "skipped",
    "failed": "failed",
    "cancelled": "cancelled",
}


@dataclass(frozen=True)
class StageEvent:
    stage: str
    kind: EventKind
    attempt: int = 0
    message: str = ""
    figures: dict[str, Any] = field(default_factory=dict)  # numbers and words; a few are lists
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class StageStatus:
    """What ``GET /v1/bootstrap`` and the CLI table show for one stage."""

    stage: str
    state: StageState = "pending"
    attempts: int = 0
    started_at: float | None = None
    duration_s: float | None = None
    error: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)  # numbers and words; a few are lists

    def after(self, event: StageEvent) -> StageStatus:
        state = _STATE_AFTER[event.kind]
        started = event.at if event.kind == "started" else self.started_at
        ended = state in ("done", "skipped", "failed", "cancelled")
        return replace(
            self,
            state=state,
            attempts=event.attempt if event.kind == "started" else max(self.attempts, event.attempt),
            started_at=started,
            duration_s=(event.at - started) if ended and started is not None else self.duration_s,
            error=event.message if state in ("failed", "cancelled") else self.error,
            figures={**self.figures, **event.figures},
        )


class EventHub:
    """Fan-out of stage events to every subscriber, plus the running status table of the
    pipeline's own stages (an operation's one-off stages are in the history only). ``relay``
    gets every event too: a hub over several pipelines (a ``Bootstrap``'s), its table unused."""

    def __init__(
        self, stage_ids: list[str] | None = None, relay: EventHub | None = None, keep: int = HISTORY_KEPT
    ) -> None:
        self.status: dict[str, StageStatus] = {s: StageStatus(s) for s in stage_ids or []}
        self._subscribers: list[MemoryObjectSendStream[StageEvent]] = []
        self.history: list[StageEvent] = []  # the newest ``keep`` at most (a server swaps for weeks)
        self.forgotten = 0  # events dropped from the front of the history so far
        self._keep = keep
        self._closed = False
        self._relay = relay

    def since(self, cursor: int) -> tuple[list[StageEvent], int]:
        """The events after the first ``cursor`` ever published (those still kept), and the
        cursor after them: a reader's place survives what the history forgets."""
        return self.history[max(cursor - self.forgotten, 0) :], self.forgotten + len(self.history)

    def publish(self, event: StageEvent) -> None:
        if self._relay is not None:
            self._relay.publish(event)
        if event.stage in self.status:
            self.status[event.stage] = self.status[event.stage].after(event)
        self.history.append(event)
        if len(self.history) > self._keep:  # forgotten half at a time: the cost stays constant per event
            cut = len(self.history) - self._keep // 2
            del self.history[:cut]
            self.forgotten += cut
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.remove(send)

    async def subscribe(self) -> AsyncIterator[StageEvent]:
        """Every event so far, then new ones as they come, until ``close()``."""
        send, receive = anyio.create_memory_object_stream[StageEvent](max_buffer_size=float("inf"))
        for event in self.history:  # no await between replay and registration: nothing is missed
            send.send_nowait(event)
        if self._closed:
            send.close()  # a late subscriber gets the history, then the end
        else:
            self._subscribers.append(send)
        async with receive:
            async for event in receive:
                yield event

    def close(self) -> None:
        self._closed = True
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()
