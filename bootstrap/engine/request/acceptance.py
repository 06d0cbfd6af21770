"""A request's recent acceptance of its draft's proposals (``auto`` speculation,
``bootstrap.engine.spec.depth``), kept on its ``Sequence``."""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of a request's older steps in its acceptance, per step


@dataclass
class Acceptance:
    """``auto``: one request's recent acceptance, as decayed counts of kept proposals and of
    proposals judged, starting from a prior of 0.8 over two proposals (a new request speculates)."""

    kept: float = 1.6
    judged: float = 2.0
    idle_steps: int = 0  # steps since it last speculated, while its best depth is 0

    def observe(self, limit: int, kept: int) -> None:
        """A step that considered ``limit`` proposals kept ``kept``: ``kept`` successes, and one
        failure unless all were kept (a full run says nothing of the next one)."""
        self.kept, self.judged = self.kept * DECAY + kept, self.judged * DECAY + kept + (kept < limit)
        self.idle_steps = 0

    @property
    def rate(self) -> float:
        return self.kept / self.judged
