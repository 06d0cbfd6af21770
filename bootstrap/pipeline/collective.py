"""Ranks that agree: the ``Collective`` port the stage runner talks to, with no torch import.

A stage attempt on several ranks (tensor parallelism) ends with one collective step
(``agree_attempt``): every rank hands in its outcome, and either all succeeded, or every rank
raises the same ``RankFailed`` naming the lowest failing rank and carrying its error. So a
failure anywhere fails the attempt everywhere, every rank rolls back, and the retry and its
adaptation follow from the same error on every rank. A stage with an ``agree`` function then
replaces its artifact on every rank by the one agreed from all ranks' (what it computes is the
domain's: ``bootstrap.capacity.agree``). Every collective has a timeout, and a rank that stops
answering surfaces as ``RankUnresponsive`` naming it. ``SingleRank`` is the no-op port of a
one-rank run; ``bootstrap.parallel.torch_dist`` holds the torch.distributed one.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class RankUnresponsive(RuntimeError):
    """A collective timed out or lost a peer; ``ranks`` are the ones that stopped answering."""

    def __init__(self, ranks: Sequence[int], what: str, detail: str) -> None:
        self.ranks = tuple(ranks)
        who = ", ".join(str(r) for r in self.ranks) or "unknown"
        super().__init__(f"rank(s) {who} stopped answering during {what}: {detail}")


class RankFailed(RuntimeError):
    """An attempt failed on ``rank`` (the lowest failing one); ``error`` is that rank's error
    (rebuilt from its pickle on the other ranks; a ``RuntimeError`` with its text when it does
    not pickle). Retry policies and adaptations look at ``error`` (``failure_of``)."""

    def __init__(self, rank: int, error: BaseException, peers_lost: bool = False) -> None:
        self.rank, self.error, self.peers_lost = rank, error, peers_lost
        lost = "; a rank lost its peers mid-collective, so the attempt is not retried" if peers_lost else ""
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}{lost}")

    def __reduce__(self) -> tuple[Any, ...]:
        return RankFailed, (self.rank, self.error, self.peers_lost)


def is_retryable(exc: BaseException, retry_on: Callable[[BaseException], bool]) -> bool:
    """``retry_on`` of the error an agreed failure stands for; never when a rank lost its
    peers inside a collective (they may be out of step: a retry could pair the wrong messages)."""
    return not getattr(exc, "peers_lost", False) and retry_on(failure_of(exc))


def is_comm_error(error: BaseException) -> bool:
    """A collective that failed or timed out (torch's ``DistError`` family, gloo's messages)."""
    names = {t.__name__ for t in type(error).__mro__}
    text = str(error)
    return bool(names & {"RankUnresponsive", "DistError", "DistBackendError", "DistNetworkError"}) or any(
        mark in text for mark in ("Connection closed by peer", "Timed out waiting", "Connection reset by peer")
    )


def failure_of(exc: BaseException) -> BaseException:
    """The error an agreed failure stands for (the exception itself otherwise)."""
    return exc.error if isinstance(exc, RankFailed) else exc


class Collective(Protocol):
    """What the pipeline needs from a group of ranks: who it is, and one all-gather."""

    rank: int
    world_size: int

    def all_gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (picklable), by rank; raises ``RankUnresponsive`` in time."""


class SingleRank:
    """The collective of a one-rank run: gathering is the value itself, nothing is awaited."""

    rank, world_size = 0, 1

    def all_gather(self, value: Any, what: str) -> list[Any]:
        return [value]


@dataclass(frozen=True)
class Outcome:
    """One rank's attempt, as gathered: its artifact when asked for, or its pickled error."""

    rank: int
    artifact: Any = None
    error: bytes | None = None
    seconds: float | None = None  # how long the attempt ran on this rank, before the agreement


def agree_attempt(
    collective: Collective,
    stage: str,
    artifact: Any,
    error: BaseException | None,
    agree: Callable[[list[Any]], Any] | None,
    seconds: float | None = None,
    timings: list[float | None] | None = None,
) -> Any:
    """The agreed artifact of this attempt on every rank, or raise the agreed failure.
    ``seconds``: how long the attempt ran here; ``timings`` is filled with every rank's, by rank."""
    shared = artifact if error is None and agree is not None else None
    mine = Outcome(collective.rank, shared, _pickled(error) if error is not None else None, seconds)
    outcomes: list[Outcome] = collective.all_gather(mine, f"stage {stage!r}")
    if timings is not None:
        timings[:] = [o.seconds for o in sorted(outcomes, key=lambda o: o.rank)]
    failed = {o.rank: error if o.rank == collective.rank else _unpickled(o.error) for o in outcomes if o.error}
    if failed:
        lost = {r for r, e in failed.items() if is_comm_error(e)}
        first = min(set(failed) - lost, default=min(failed))  # the cause, not a peer left waiting on it
        raise RankFailed(first, failed[first], peers_lost=bool(lost))
    return agree([o.artifact for o in outcomes]) if agree is not None else artifact


def _pickled(error: BaseException) -> bytes:
    try:
        data = pickle.dumps(error)
        pickle.loads(data)  # an exception whose __init__ takes other arguments pickles but does not load
        return data
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def _unpickled(data: bytes) -> BaseException:
    return pickle.loads(data)
