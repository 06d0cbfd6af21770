"""What speculative decoding measures as it runs: acceptance counts (``SpeculationStats``, in
``/metrics``, ``bootstrap run --json`` and the executor's stats) and where a step's time goes
(``StepClock``, the figures ``auto`` weighs)."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch


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


class StepClock:
    """Where a speculative step's time goes: its wall time, split between the draft's passes and
    the verify pass (with the judging) in the proportion the device spent on each. On CUDA the
    host queues the passes without waiting, so the split is read from events, and the wall time
    runs until the host has the verdict; on the CPU every operation ends before the next starts,
    and the host's clock splits it up to the verdict (``verified``)."""

    def __init__(self, device: torch.device) -> None:
        self.started = time.perf_counter()
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else None
        self.drafted_at = self.verified_at = self.started
        if self.events is not None:
            self.events[0].record()

    def drafted(self) -> None:
        self.drafted_at = time.perf_counter()
        if self.events is not None:
            self.events[1].record()

    def verified(self) -> None:
        """The verdict is queued: what comes after it (the next step's first draft pass, queued
        ahead) is not this step's."""
        self.verified_at = time.perf_counter()
        if self.events is not None:
            self.events[2].record()

    def split(self) -> tuple[float, float]:
        """(seconds drafting, seconds verifying), once the host has the verdict."""
        if self.events is None:
            wall = self.verified_at - self.started
            share = (self.drafted_at - self.started) / wall if wall > 0 else 0.0
        else:
            wall = time.perf_counter() - self.started
            start, drafted, end = self.events
            end.synchronize()
            drafting, verifying = start.elapsed_time(drafted), drafted.elapsed_time(end)
            share = drafting / (drafting + verifying) if drafting + verifying > 0 else 0.0
        return wall * share, wall * (1 - share)
