"""Rank 0 decides, every rank runs: the channel of ``bootstrap serve --tp N``.

Rank 0 alone takes requests, schedules and samples. Before each forward its runner sends the
step's host inputs (``engine.step.mixed_step``) to the other ranks, which run the same forward
on their shards and pools; the model's own all-reduces then keep the ranks in step. Live
operations go the same way: ``Operation`` when one begins on rank 0 (the others run the same
method, whose stages agree collectively), ``Drained`` once rank 0's requests are drained (the
old executor sends no step after it), ``Done`` when it is over (the new executor's steps come
after it), and ``Stop`` at the end.

The channel is ``broadcast_object_list`` from rank 0 on a gloo group of its own (CPU, for NCCL
ranks too), without a timeout: a server idles as long as it likes, and a dead rank's closed
sockets fail the next send or receive at once. A step that fails on rank 0 after it was sent
leaves the ranks out of step: the leader refuses every later step, and the server ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bootstrap.parallel.torch_dist import first_line

NO_TIMEOUT = timedelta(days=365)  # a server idles as long as it likes; a dead peer fails at once


@dataclass(frozen=True)
class Operation:
    """Run ``Bootstrap.<method>(*args)`` (a live operation, or a retry of the build)."""

    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Drained:
    """Rank 0's requests are drained: no step of the old executor follows."""


@dataclass(frozen=True)
class Done:
    """Rank 0's operation is over: the steps that follow are the new executor's."""


@dataclass(frozen=True)
class Stop:
    """The server stops: leave, release, exit."""


class OutOfStep(RuntimeError):
    """The ranks can no longer run the same steps (a rank is gone, or a sent step failed)."""


class StepsClosed(RuntimeError):
    """A step of an executor whose operation drained it: the other ranks left it."""


def lockstep_group() -> Any:
    """The channel's gloo group (every rank calls this once, in the same order)."""
    return dist.new_group(backend="gloo", timeout=NO_TIMEOUT)


class Leader:
    """Rank 0's side: steps from the runner's thread, operations from the event loop, one at a
    time (``broadcast_object_list`` must not interleave). ``on_broken``: called once, with the
    reason, when the ranks fall out of step."""

    def __init__(self, group: Any, on_broken: Callable[[str], None] = lambda reason: None) -> None:
        self._group = group
        self._lock = threading.Lock()
        self._steps_open = True
        self._broken: str | None = None
        self.on_broken = on_broken
        self._stopped = False

    def send(self, step: object, tensors: Sequence[torch.Tensor] = ()) -> None:
        """A step's host inputs, before rank 0 runs it (``ModelRunner.lockstep``), then the
        device tensors it names, broadcast on the model's own group (``receive`` takes them)."""
        with self._lock:
            if not self._steps_open:
                raise StepsClosed("this executor was drained for an operation; its steps no longer run")
            self._post(step, tensors)

    def failed(self, exc: BaseException) -> None:
        """A sent step failed here: the other ranks ran it, or wait in its collectives."""
        with self._lock:
            self._break(f"a step failed on rank 0 after the other ranks were sent it: {type(exc).__name__}: {exc}")

    def begin(self, method: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self._post(Operation(method, args))

    def drained(self) -> None:
        with self._lock:
            self._steps_open = False
            self._post(Drained())

    def done(self) -> None:
        with self._lock:
            self._steps_open = True
            if self._broken is None:  # an operation that failed on a lost rank ends here
                self._post(Done())

    def stop(self) -> None:
        """Tell the other ranks to stop (once; nothing when they are gone already)."""
        with self._lock:
            self._steps_open = False
            if self._stopped or self._broken is not None:
                return
            self._stopped = True
            with contextlib.suppress(RuntimeError):  # gone: nothing to tell
                dist.broadcast_object_list([Stop()], src=0, group=self._group)

    def _post(self, message: object, tensors: Sequence[torch.Tensor] = ()) -> None:
        """``message`` on the channel, then ``tensors`` on the model's own group; a failure of
        either breaks the lockstep."""
        if self._broken is not None:
            raise OutOfStep(self._broken)
        try:
            dist.broadcast_object_list([message], src=0, group=self._group)
            for tensor in tensors:
                dist.broadcast(tensor.contiguous(), src=0)
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            self._break(f"another rank stopped answering: {first_line(exc)}")
            raise OutOfStep(self._broken) from exc

    def _break(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
            self.on_broken(reason)


class Follower:
    """A rank > 0's side: what rank 0 sent, in order."""

    def __init__(self, group: Any) -> None:
        self._group = group

    @staticmethod
    def receive_tensor(tensor: torch.Tensor) -> None:
        """A device tensor that follows a step (``Leader.send``), into ``tensor``."""
        try:
            dist.broadcast(tensor, src=0)
        except RuntimeError as exc:
            raise OutOfStep(f"rank 0 stopped answering: {first_line(exc)}") from exc

    def receive(self) -> object:
        box: list[object] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self._group)
        except RuntimeError as exc:
            raise OutOfStep(f"rank 0 stopped answering: {first_line(exc)}") from exc
        return box[0]
