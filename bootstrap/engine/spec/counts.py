"""``SpeculationStats``: speculative decoding's acceptance counts since the executor started;
torch-free, so they cross the engine channel (``bootstrap.engine.executor.channel``) to the server's ``/metrics``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """Proposals and acceptances since the executor started, per draft position too."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: proposals kept at draft position i
    proposed_at: list[int] = field(default_factory=list)

    def count(self, limits: Seq[int], accepted: Seq[int]) -> None:
        """One step: row ``i`` judged ``limits[i]`` proposals and kept ``accepted[i]``."""
        self.steps += 1
        self.proposed += sum(limits)
        self.accepted += sum(accepted)
        for position in range(max(limits)):
            if position >= len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[position] += sum(limit > position for limit in limits)
            self.accepted_at[position] += sum(n > position for n in accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def to_dict(self) -> dict:
        """``bootstrap run --json``'s ``speculation``: counts, the acceptance rate, the mean
        accepted run per step and row, and the acceptance rate at each draft position."""
        rows = self.proposed_at[0] if self.proposed_at else 0
        return {
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.accepted / rows, 4) if rows else None,
            "acceptance_by_position": [round(a / p, 4) for a, p in zip(self.accepted_at, self.proposed_at)],
        }
