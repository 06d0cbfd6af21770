"""When a request passed each point in the engine, and what it used: the figures behind a
request's trace (``bootstrap.serve.request_trace``) and the server's slowest-requests list.

The engine thread writes a ``RequestClock`` (one per ``Sequence``) as the request moves:
``enqueued_ns`` when it is made, ``scheduled_ns`` when the scheduler admits it (its KV reserved,
its prefill may start), ``first_token_ns`` when its first token is sampled, a prefill step per
step that runs a chunk of its prompt, and the KV blocks it holds as it finishes. Its final
stream event and its ``Response`` carry a frozen ``RequestTiming`` made from it then. Times are
``time.time_ns()``, the clock OpenTelemetry spans take, so a span can be placed from them.
The cost is three clock reads per request and one counter per prefill step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestTiming:
    """One finished request's passage: ``scheduled_ns`` and ``first_token_ns`` are None when it
    ended before getting there (cancelled while queued, refused, failed in its prefill)."""

    enqueued_ns: int
    scheduled_ns: int | None
    first_token_ns: int | None
    finished_ns: int
    prefill_steps: int  # steps that ran a chunk of its prompt (a fork shares its parent's)
    kv_blocks: int  # KV blocks it held when it finished, the prompt's shared ones included

    @property
    def queue_s(self) -> float:
        """Waiting for admission (to its end, if it never was admitted)."""
        return ((self.scheduled_ns or self.finished_ns) - self.enqueued_ns) / 1e9

    @property
    def prefill_s(self) -> float | None:
        if self.scheduled_ns is None:
            return None
        return ((self.first_token_ns or self.finished_ns) - self.scheduled_ns) / 1e9

    @property
    def decode_s(self) -> float | None:
        return None if self.first_token_ns is None else (self.finished_ns - self.first_token_ns) / 1e9

    @property
    def total_s(self) -> float:
        return (self.finished_ns - self.enqueued_ns) / 1e9


@dataclass(slots=True)
class RequestClock:
    """What the engine thread records of one request as it runs (see the module docstring)."""

    enqueued_ns: int = field(default_factory=time.time_ns)
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    prefill_steps: int = 0
    kv_blocks: int = 0

    def scheduled(self) -> None:
        if self.scheduled_ns is None:
            self.scheduled_ns = time.time_ns()

    def sampled(self) -> None:
        if self.first_token_ns is None:
            self.first_token_ns = time.time_ns()

    def joined(self, parent: RequestClock) -> None:
        """A fork joins its parent as its prefill ends: the parent's admission and steps are its own."""
        self.scheduled_ns, self.prefill_steps = parent.scheduled_ns, parent.prefill_steps

    def timing(self) -> RequestTiming:
        """The frozen record, as the request finishes now."""
        return RequestTiming(
            self.enqueued_ns, self.scheduled_ns, self.first_token_ns, time.time_ns(), self.prefill_steps, self.kv_blocks
        )
