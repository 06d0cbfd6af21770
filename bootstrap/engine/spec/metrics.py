"""What speculative decoding measures as it runs: acceptance counts (``SpeculationStats``, in
``/metrics``, ``bootstrap run --json`` and the executor's stats) and where a step's time goes
(``StepClock``, the figures ``auto`` weighs)."""

from __future__ import annotations

import time

import torch

from bootstrap.engine.spec.counts import SpeculationStats as SpeculationStats  # re-exported


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
