"""What one forward step runs: the scheduler's choice of requests and tokens, which the runner,
the speculator and the loop take."""

from __future__ import annotations

from dataclasses import dataclass

from bootstrap.engine.request.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One forward step: ``num_new_tokens[i]`` tokens of ``seqs[i]``, in this order."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    rows: list[int] | None = None  # the logits row of each sampling request, when forks share their parent's

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """True when every request runs exactly its one last sampled token."""
        return all(n == 1 and not s.in_prefill for s, n in zip(self.seqs, self.num_new_tokens))

    def split(self) -> list[ScheduledBatch]:
        """One single-request batch per request, same tokens."""
        return [ScheduledBatch([s], [n]) for s, n in zip(self.seqs, self.num_new_tokens)]

    def samples(self) -> list[bool]:
        """Per request: does this step complete its pending tokens, so a token gets sampled?"""
        return [s.num_computed + n == s.num_tokens + s.in_flight for s, n in zip(self.seqs, self.num_new_tokens)]

    def without_finished(self) -> ScheduledBatch:
        """The batch less the requests that finished since it was planned (an overlapped step's
        tokens, read late, ended them)."""
        kept = [i for i, s in enumerate(self.seqs) if not s.finished]
        return ScheduledBatch([self.seqs[i] for i in kept], [self.num_new_tokens[i] for i in kept])
