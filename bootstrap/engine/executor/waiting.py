"""How callers wait for what the engine leaves on a request's handle (the rules are in
``bootstrap.engine.executor.request_table``).

Sync waits sleep on the handle's condition while a worker runs the loop, and otherwise drive
the loop in the calling thread. Async waits sleep on a ``Waker`` while a worker runs, and
otherwise run one step at a time in an anyio worker thread that is never abandoned: a
cancellation takes effect when that step ends, and the thread has taken nothing. No wait polls,
and none spins: a wait that drives the loop and finds nothing to run twice in a row raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

from bootstrap.engine.executor.request_table import Claim, Handle, RequestTable
from bootstrap.engine.request.sequence import StreamEvent

T = TypeVar("T")


class Waiter:
    """Waits on the handles of one ``RequestTable``; ``step_here`` runs one loop iteration in
    the calling thread unless a worker runs the loop, and says whether there was anything to do."""

    def __init__(self, table: RequestTable, step_here: Callable[[], bool]) -> None:
        self.table = table
        self.step_here = step_here

    def wait(self, handle: Handle, take: Callable[[Handle], T | None], deadline: float | None) -> T | None:
        """What ``take`` hands over once it has something (``take`` runs under the table's lock,
        in this thread); None past ``deadline`` (``time.monotonic``)."""
        stalled = False
        while True:
            with self.table.lock:
                got = take(handle)
                left = None if deadline is None else deadline - time.monotonic()
                if got is not None or (left is not None and left <= 0):
                    return got
                if self.table.worker_live:
                    handle.changed.wait(left)
                    continue
            stalled = _stalled(handle, self.step_here(), stalled)

    async def wait_async(self, handle: Handle, take: Callable[[Handle], T | None]) -> T:
        """``wait`` for a task, with no deadline (cancel it instead): ``take`` runs in the task
        itself, so a cancellation never falls between taking and returning."""
        stalled = False
        while True:
            with self.table.lock:
                got = take(handle)
                if got is not None:
                    return got
                waker = self.table.arm(handle) if self.table.worker_live else None
            if waker is None:
                stalled = _stalled(handle, await anyio.to_thread.run_sync(self.step_here), stalled)
            else:
                await waker.event.wait()


def _stalled(handle: Handle, progressed: bool, stalled_before: bool) -> bool:
    """After a step of our own: raise rather than spin when twice in a row there was nothing to
    run and still nothing for us (an unfinished request is always in the inbox or the scheduler,
    so this is a bug, not a state to wait out)."""
    if progressed:
        return False
    if stalled_before:
        raise RuntimeError(f"request {handle.request_id} cannot progress: the loop has nothing to run")
    return True


class EventStream:
    """The async stream of one request's events: attached to the request from the first
    ``__anext__`` until the final event, an exception (a cancelled wait included), ``aclose``
    or garbage collection, whichever comes first. Not an async generator, whose ``finally``
    waits for the event loop to finalize it: this one lets go the moment it is unreachable, so
    a stream dropped unclosed in the middle of its loop does not block the next one."""

    def __init__(self, waiter: Waiter, request_id: int, cancel_on_abandon: bool) -> None:
        self._waiter = waiter
        self._request_id = request_id
        self._cancel_on_abandon = cancel_on_abandon
        self._claim: Claim | None = None
        self._ended = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._ended:
            raise StopAsyncIteration
        table = self._waiter.table
        try:
            if self._claim is None:
                self._claim = table.attach(self._request_id, "stream_async")
            event = await self._waiter.wait_async(self._claim.handle, table.take_event)
        except BaseException:
            self._end(abandoned=True)
            raise
        if event.finished:
            self._end(abandoned=False)
        return event

    async def aclose(self) -> None:
        self._end(abandoned=True)

    def __del__(self) -> None:
        self._end(abandoned=True)

    def _end(self, abandoned: bool) -> None:
        self._ended = True
        claim, self._claim = self._claim, None
        if claim is not None:
            self._waiter.table.detach(claim.handle, claim, give_up=abandoned and self._cancel_on_abandon)
