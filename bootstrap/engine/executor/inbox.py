"""``Inbox``: how requests reach the engine loop from any thread.

Callers ``post`` checked requests (``PyExecutor.enqueue``) and ``shutdown`` posts ``None`` to
wake an idle worker; the loop, holding its step lock, moves what was posted into the scheduler
(``drain_into``), skipping requests cancelled while queued. An idle worker sleeps in ``wait``.
"""

from __future__ import annotations

import queue

from bootstrap.engine.request.sequence import Sequence
from bootstrap.engine.scheduler import Scheduler


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.Queue[Sequence | None] = queue.Queue()

    def post(self, item: Sequence | None) -> None:
        """A request for the loop, or None: a wake-up call."""
        self._queue.put(item)

    def pending(self) -> int:
        """Items posted and not yet taken (approximate while others post; safe from any thread)."""
        return self._queue.qsize()

    def wait(self) -> Sequence | None:
        """Block until something is posted; return it (a worker with no work sleeps here)."""
        return self._queue.get()

    def drain_into(self, scheduler: Scheduler, first: Sequence | None = None) -> bool:
        """Add ``first`` and everything posted so far to ``scheduler``; True if anything was
        posted. A request finished while queued (cancelled) is skipped."""
        took = False
        item = first
        while True:
            if item is not None and not item.finished:
                scheduler.add(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return took
            took = True
