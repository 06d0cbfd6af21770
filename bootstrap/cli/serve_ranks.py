"""``bootstrap serve --tp N``: rank 0 serves, every other rank follows it.

Started by hand, the command launches N ranks as ``run --tp N`` does (``cli.tp``); under
``torchrun`` each process is one rank. Every rank joins the process groups and the lockstep
channel (``parallel.lockstep``) and runs the same stages, which agree as they do for ``run``.
Rank 0 opens the port, takes requests, schedules and samples; its runner sends every step to
the others (``lead``). A rank > 0 opens nothing (``follow``): it builds, then runs what rank 0
sends (steps on its shard, the live operations, the stop), writes its own trace file
(``<name>.rank<r><suffix>``), and exits 0 once rank 0 stops it.

Stops: a stop signal to any rank reaches rank 0 (a rank > 0 sets ``STOP_KEY`` in the
rendezvous store, which rank 0 watches), and rank 0 drains, releases and sends ``Stop``. A rank
that is lost ends the server: rank 0's next step fails, the requests in flight end with the
error, and it exits 1 with a line saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from bootstrap.cli.exits import OK, STAGE_FAILED
from bootstrap.cli.stops import STOP_SIGNALS
from bootstrap.cli.tp import rank_backend, this_rank

log = logging.getLogger("bootstrap.serve")
STOP_KEY = "bootstrap/serve/stop"  # in the rendezvous store: a rank > 0 heard a stop signal
WATCH_S = 60.0  # how long the watcher's wait on the store lasts before it waits again
OPERATIONS_WITH_DRAIN = {"swap", "update_weights", "sleep"}


def rank_trace_file(path: Path | None, rank: int) -> Path | None:
    """Rank ``rank``'s trace file beside rank 0's: ``trace.jsonl`` -> ``trace.rank1.jsonl``."""
    return None if path is None or rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


# ---- rank 0 ------------------------------------------------------------------------------------


class Leading:
    """Rank 0's side of the server: the backend that joins the ranks, the watcher of the other
    ranks' stop signals, and what happens when the ranks fall out of step."""

    def __init__(self, state: Any, args: argparse.Namespace, stop_server: Callable[[], None]) -> None:
        self.state, self.args, self.stop_server = state, args, stop_server
        self.loop = asyncio.get_running_loop()
        self.lost: str | None = None
        self._watcher: threading.Thread | None = None
        self._store: Any = None
        self._closing = threading.Event()
        state.make_backend = self.make_backend

    def make_backend(self, config: Any) -> Any:
        """Join the ranks (off the event loop: ``make_bootstrap``); the backend's executors lead."""
        from bootstrap.parallel.lockstep import Leader, lockstep_group

        backend = rank_backend(config, self.args)
        leader = Leader(lockstep_group(), self._broken)
        backend.lockstep = self.state.ranks = leader
        self._watch()
        return backend

    def _broken(self, reason: str) -> None:
        """The ranks are out of step (any thread): the server stops, exit status 1."""
        self.lost = reason
        self.loop.call_soon_threadsafe(self._end, reason)

    def _end(self, reason: str) -> None:
        log.error("bootstrap serve: the ranks are out of step: %s; the server stops", reason)
        self.state.begin_shutdown()  # new requests refused at once; those in flight fail in their next step
        self.stop_server()

    def _watch(self) -> None:
        self._store = rendezvous_store()  # its own connection: a client waiting blocks its socket
        self._watcher = threading.Thread(target=self._wait_for_stop, name="bootstrap-rank-stops", daemon=True)
        self._watcher.start()

    def _wait_for_stop(self) -> None:
        while not self._closing.is_set():
            try:
                self._store.wait([STOP_KEY], timedelta(seconds=WATCH_S))
            except RuntimeError as exc:  # DistStoreError: a timeout (wait again), or the store gone
                if "timeout" in str(exc).lower():
                    continue
                return
            if not self._closing.is_set():
                rank = self._store.get(STOP_KEY).decode()
                self.loop.call_soon_threadsafe(self._stop_asked, rank)
            return

    def _stop_asked(self, rank: str) -> None:
        if self.state.phase != "shutting_down":
            log.warning("rank %s heard a stop signal: shutting down", rank)
            self.state.begin_shutdown()  # as a signal to this process does: the drain begins now
            self.stop_server()

    def close(self) -> None:
        """End the watcher (once the server is down)."""
        watcher, self._watcher = self._watcher, None
        self._closing.set()
        if watcher is not None:
            with contextlib.suppress(RuntimeError):  # the store gone with the agent: the wait ends by itself
                rendezvous_store().set(STOP_KEY, "0")
            watcher.join(WATCH_S)


# ---- ranks > 0 ---------------------------------------------------------------------------------


def main_follower(config: Any, args: argparse.Namespace) -> tuple[int, bool]:
    """A rank > 0 of ``serve --tp N``: build, follow rank 0 until it says stop; the exit status,
    and whether a stop signal came."""
    from bootstrap.api import Bootstrap
    from bootstrap.parallel.lockstep import Follower, lockstep_group

    rank = this_rank()
    heard: list[int] = []

    def note(signum: int, frame: object) -> None:  # a stop signal is rank 0's to act on
        if not heard:
            _ask_rank_0_to_stop(rank)
        heard.append(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, note)
    backend = rank_backend(config, args)
    channel = Follower(lockstep_group())
    if heard:  # heard while joining: rank 0 could not be asked yet
        _ask_rank_0_to_stop(rank)
    boot = Bootstrap(config, backend=backend, trace_file=rank_trace_file(args.trace_file, rank), process=args.process)
    return anyio.run(Following(boot, channel, rank, heard).run, bool(getattr(args, "idle", False))), bool(heard)


class Following:
    """What a rank > 0 runs: rank 0's steps in a thread, its operations on the event loop."""

    def __init__(self, boot: Any, channel: Any, rank: int, heard: list[int]) -> None:
        self.boot, self.channel, self.rank = boot, channel, rank
        self.runners: dict[str, Any] = {}  # the serving executor's, by role: target (and draft)
        self.heard = heard  # the stop signals this rank heard
        self.drained = anyio.Event()
        self.finished = anyio.Event()
        self.tasks: anyio.abc.TaskGroup | None = None

    async def run(self, idle: bool) -> int:
        from bootstrap.parallel.lockstep import OutOfStep

        try:
            async with anyio.create_task_group() as tasks:
                self.tasks = tasks
                if not idle:
                    await self._settle(self.boot.build)
                try:
                    await anyio.to_thread.run_sync(self._receive)
                    status = OK
                except OutOfStep as exc:
                    status = OK if self.heard else STAGE_FAILED
                    if status:
                        print(f"bootstrap: rank {self.rank}: {exc}", file=sys.stderr, flush=True)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.boot.aclose()
        return status

    def _receive(self) -> None:
        """Rank 0's messages, in order, until ``Stop`` (in a thread: the receive blocks)."""
        from bootstrap.parallel.lockstep import Stop

        while not isinstance(message := self.channel.receive(), Stop):
            if not _is_step(message):
                anyio.from_thread.run(self._control, message)
            elif message.model in self.runners:
                self.runners[message.model].follow(message, self.channel.receive_tensor)
            else:
                raise RuntimeError(f"rank {self.rank} has no {message.model} runner for rank 0's step")

    async def _control(self, message: Any) -> None:
        from bootstrap.parallel.lockstep import Drained, Operation

        if isinstance(message, Operation):
            self.drained, self.finished = anyio.Event(), anyio.Event()
            self.tasks.start_soon(self._operate, message)
        elif isinstance(message, Drained):
            self.drained.set()
            self.runners = {}  # the old executor is drained: no step of it follows
        else:  # Done: the next steps are the new executor's
            await self.finished.wait()

    async def _operate(self, operation: Any) -> None:
        method = getattr(self.boot, operation.method)
        try:
            if operation.method in OPERATIONS_WITH_DRAIN:
                await self._settle(lambda: method(*operation.args, drain=self.drained.wait))
            else:
                await self._settle(lambda: method(*operation.args))
        finally:
            self.finished.set()

    async def _settle(self, call: Callable[[], Any]) -> None:
        """Run a build or an operation; its failures are rank 0's to report (the stages agree)."""
        try:
            await call()
        except Exception as exc:  # rank 0 reports the agreed failure
            log.debug("rank %d: %s: %s", self.rank, type(exc).__name__, exc)
        executor = self.boot.executor
        speculator = getattr(executor, "speculator", None)
        self.runners = {"target": executor.runner} if executor is not None else {}
        if speculator is not None:
            self.runners["draft"] = speculator.draft


def rendezvous_store() -> Any:
    """A new client of the store the launcher's ranks met at (``MASTER_ADDR``, ``MASTER_PORT``)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


def _ask_rank_0_to_stop(rank: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # not joined yet: asked once it has
        return
    with contextlib.suppress(RuntimeError):  # rank 0's agent is gone: rank 0 is stopping already
        rendezvous_store().set(STOP_KEY, str(rank))


def _is_step(message: Any) -> bool:
    from bootstrap.engine.step.mixed_step import BlockCopy, MixedStep, RowsStep

    return isinstance(message, MixedStep | RowsStep | BlockCopy)
