"""A stage: a function whose parameters name the artifacts it needs, plus its retry policy.

Hamilton-style: ``def profiling(estimation, loaded, config, backend, undo)`` needs the artifacts
``estimation``, ``loaded``, ``config`` and ``backend``; ``undo`` is injected per attempt. The
pipeline derives the graph from these names, so the stage table documents itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bootstrap.devices import is_oom

INJECTED = frozenset({"undo"})


@dataclass(frozen=True)
class RetryPolicy:
    """Declarative retry data, turned into tenacity arguments by the pipeline."""

    attempts: int = 1
    retry_on: Callable[[BaseException], bool] = is_oom
    backoff_s: float = 0.0  # first wait; doubles each retry
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")


NO_RETRY = RetryPolicy()


def on_oom(attempts: int = 3, backoff_s: float = 0.0) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, retry_on=is_oom, backoff_s=backoff_s)


def is_transient_io(exc: BaseException) -> bool:
    """An I/O error a second try may not meet (a timeout, a dropped connection, a busy file
    system); a missing file or a permission refused is not one."""
    return isinstance(exc, TimeoutError | ConnectionError) or (
        isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError)
    )


class GiveUp(RuntimeError):
    """Raised by an ``adapt`` that finds nothing left to change: the stage fails with this
    reason (the error that triggered the adaptation is its ``__cause__``), without retrying."""


@dataclass(frozen=True)
class Adaptation:
    """Inputs a stage changes for its next attempt, and a readable note of each change."""

    inputs: Mapping[str, Any]
    changes: Mapping[str, str]  # e.g. {"max_num_tokens": "8192 -> 4096"}


@dataclass(frozen=True)
class Skip:
    """A stage that need not run: the artifact it provides instead, and why."""

    artifact: Any
    reason: str


@dataclass(frozen=True)
class Stage:
    id: str
    fn: Callable[..., Any]
    provides: str
    retry: RetryPolicy = NO_RETRY
    adapt: Callable[[BaseException, Mapping[str, Any]], Adaptation | None] | None = None
    skip: Callable[..., Skip | None] | None = None  # called with the same inputs as fn
    consumes: tuple[str, ...] = ()  # artifacts released once this stage succeeds
    blocking: bool = True  # run fn in the device thread
    figures: Callable[[Any], Mapping[str, int | float | str]] | None = None  # span attributes
    oom_advice: str = ""  # what to change when this stage runs out of memory for good
    # On several ranks: every rank's artifact of a successful attempt to the one all keep
    # (``bootstrap.pipeline.collective``); None keeps each rank's own.
    agree: Callable[[list[Any]], Any] | None = None

    @property
    def requires(self) -> tuple[str, ...]:
        return artifact_names(self.fn)

    @property
    def wants_undo(self) -> bool:
        return "undo" in inspect.signature(self.fn).parameters


def artifact_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The artifacts ``fn`` names: its parameters without a default, the injected ``undo`` aside."""
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.name not in INJECTED and p.default is p.empty)
