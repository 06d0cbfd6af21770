"""The requests the server answered lately, for the status page: each one's time in the queue,
in prefill and in decode (the engine's ``RequestTiming``), its tokens and how it ended. Kept for
every request, traced or not; bounded (``RECENT``), the oldest dropped first. Event loop only."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from bootstrap.engine.request.timing import RequestTiming

RECENT = 256  # requests kept; the page shows the slowest of them
SLOWEST = 8


class ClosedChoice(Protocol):
    """What a summary reads of each closed choice: a ``bootstrap.serve.openai.jobs.Job`` (not
    imported: the jobs import the state, which holds the recent requests)."""

    request_id: int
    tokens: int
    timing: RequestTiming | None

    @property
    def reason(self) -> str: ...


@dataclass(frozen=True)
class RequestSummary:
    """One answered request (its slowest choice's phases; ``trace_id`` when it was traced)."""

    request_id: int
    endpoint: str
    finished_at: float  # time.time() seconds
    total_s: float
    queue_s: float
    prefill_s: float | None
    decode_s: float | None
    prompt_tokens: int
    output_tokens: int
    choices: int
    finish_reason: str
    trace_id: str | None = None

    @classmethod
    def of(
        cls, endpoint: str, jobs: Sequence[ClosedChoice], prompt_tokens: int, trace_id: str | None
    ) -> RequestSummary | None:
        """From a request's closed jobs; None when none reached the engine's end (no timing)."""
        timed = [job for job in jobs if job.timing is not None]
        if not timed:
            return None
        slowest = max(timed, key=lambda job: job.timing.total_s)
        t = slowest.timing
        return cls(
            slowest.request_id,
            endpoint,
            t.finished_ns / 1e9,
            round(t.total_s, 6),
            round(t.queue_s, 6),
            _round(t.prefill_s),
            _round(t.decode_s),
            prompt_tokens,
            sum(job.tokens for job in jobs),
            len(jobs),
            slowest.reason,
            trace_id,
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class RecentRequests:
    """The last ``RECENT`` answered requests, and the tokens generated since the server started."""

    def __init__(self, size: int = RECENT) -> None:
        self._kept: deque[RequestSummary] = deque(maxlen=size)
        self.answered = 0

    def add(self, summary: RequestSummary | None) -> None:
        if summary is not None:
            self._kept.append(summary)
            self.answered += 1

    def slowest(self, count: int = SLOWEST) -> list[dict[str, Any]]:
        """The ``count`` slowest of those kept, slowest first."""
        return [asdict(s) for s in sorted(self._kept, key=lambda s: s.total_s, reverse=True)[:count]]

    def __len__(self) -> int:
        return len(self._kept)
