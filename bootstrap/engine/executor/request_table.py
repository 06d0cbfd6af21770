"""Request handles: where the engine leaves each request's events and response, and where
callers (threads or async tasks) pick them up. The rules ``PyExecutor``'s callers rely on:

- **One consumer at a time.** A stream or an await attaches while it runs; a second one raises
  ``RequestInUse``. Once the first detaches (done, timed out, cancelled, closed), the next may.
- **Nothing is lost to a cancelled wait.** An event or response leaves its handle only in the
  consumer's own thread or task, under the lock, as it is handed over (``take_event``,
  ``take_response``). A wait that is cancelled or times out has taken nothing.
- **Bounded retention.** A handle lives from enqueue until its final event is streamed or its
  response taken; one given up (``cancel``, ``cancel_on_abandon``) is released once finished and
  unattached; of the unattached finished ones, the ``max_unclaimed`` latest are kept.
- **Wakeups, not polling.** Threads wait on a per-handle condition; an async consumer's ``Waker``
  is set from its event loop, one callback per loop and round (``wakes_batched``). A routed
  request (``Route``: the engine channel's) has no consumer: its events go to an outbox, a round's at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import anyio

from bootstrap.config import is_int
from bootstrap.engine.executor.event_loops import call_soon_threadsafe
from bootstrap.engine.request.sequence import Detokenizer, Response, Sequence, StreamEvent

log = logging.getLogger(__name__)


Outbox = Callable[[list[tuple[int, StreamEvent]]], None]


@dataclass(frozen=True)
class Route:
    """Where a routed request's events go: ``outbox`` gets (``key``, event) pairs."""

    outbox: Outbox
    key: int


class RequestInUse(RuntimeError):
    """A second stream or await on a request that already has one attached."""


class Waker:
    """Wakes one async task from any thread, without blocking that thread."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.call_soon = call_soon_threadsafe()

    def wake(self) -> None:
        _schedule(self.call_soon, self.event.set)


def _schedule(call_soon: Callable[[Callable[[], object]], object], callback: Callable[[], object]) -> None:
    # not contextlib.suppress: this runs for every round, where try costs nothing
    try:  # noqa: SIM105
        call_soon(callback)
    except RuntimeError:  # its event loop has ended: nobody waits on it any more
        pass


def _set_all(sets: Iterable[Callable[[], None]]) -> None:
    for set_event in sets:
        set_event()


@dataclass(eq=False)
class Handle:
    """One request as callers see it; fields other than ``seq``, ``detokenizer`` and ``emitted``
    (the engine's own) change only under the table's lock."""

    seq: Sequence
    detokenizer: Detokenizer | None
    changed: threading.Condition
    events: deque[StreamEvent] = field(default_factory=deque)
    response: Response | None = None
    emitted: int = 0
    consumer: Claim | None = None
    waker: Waker | None = None
    given_up: bool = False
    route: Route | None = None  # its events go to an outbox, not to a consumer here

    @property
    def request_id(self) -> int:
        return self.seq.request_id

    @property
    def finished(self) -> bool:
        return self.response is not None


@dataclass(eq=False)
class Claim:
    """One consumer's hold on one or more handles (``generate`` holds all of its requests)."""

    label: str
    handle: Handle | None = None


@dataclass(frozen=True)
class RequestStats:
    """``handles``: every request the executor holds; ``unfinished``: of those, not answered
    yet; ``unclaimed``: answered and waiting for nobody (bounded); ``attached``: with a consumer."""

    handles: int
    unfinished: int
    unclaimed: int
    attached: int


class RequestTable:
    """Every request's handle, from enqueue until it is taken or released; see the module docstring.

    Consumers leave through ``detach``, which never blocks on the lock, so it is safe in a
    ``finally`` that a garbage collector may run while this thread holds the lock: it queues the
    departure, and every locked operation applies queued departures first (``_reap``).
    """

    def __init__(self, max_unclaimed: int) -> None:
        if not is_int(max_unclaimed) or max_unclaimed < 0:
            raise ValueError(f"max_unclaimed must be an integer >= 0, got {max_unclaimed!r}")
        self.lock = threading.Lock()
        self.max_unclaimed = max_unclaimed
        self.worker_live = False  # a worker thread runs the loop; changes under the lock
        self._handles: dict[int, Handle] = {}
        self._unclaimed: OrderedDict[int, None] = OrderedDict()
        self._cancelled: set[int] = set()  # given up unfinished: the engine must still cancel them
        self._departures: deque[tuple[Handle, Claim, bool]] = deque()
        self._batch: dict[Callable, dict[int, Callable[[], None]]] | None = None  # wakes held (wakes_batched)
        self._routed: dict[Outbox, list[tuple[int, StreamEvent]]] = {}  # routed events held (wakes_batched)

    def new_handle(self, seq: Sequence, detokenizer: Detokenizer | None) -> Handle:
        return Handle(seq, detokenizer, threading.Condition(self.lock))

    def add(self, handles: Iterable[Handle], claim: Claim | None = None) -> None:
        """Register new handles, held by ``claim`` if given (call under the lock)."""
        for handle in handles:
            handle.consumer = claim
            self._handles[handle.request_id] = handle

    def get(self, request_id: int) -> Handle | None:
        """The engine's view: the handle of an unfinished request (or of a retained one)."""
        return self._handles.get(request_id)

    # ---- consumers ----------------------------------------------------------------------------

    def attach(self, request_id: int, label: str) -> Claim:
        """Attach a consumer to the request, or raise ``KeyError`` / ``RequestInUse``."""
        with self.lock:
            self._reap()
            handle = self._handles.get(request_id)
            if handle is None or handle.given_up:
                raise KeyError(
                    f"unknown request id {request_id} (never enqueued, its response already taken, "
                    "or released: cancelled, or finished and unclaimed past the retention bound)"
                )
            if handle.consumer is not None:
                raise RequestInUse(
                    f"request {request_id} is already being consumed by {handle.consumer.label}; one "
                    "stream or await per request at a time (finish or close the other one first)"
                )
            handle.consumer = Claim(label, handle)
            self._unclaimed.pop(request_id, None)
            return handle.consumer

    def detach(self, handle: Handle, claim: Claim, give_up: bool = False) -> None:
        """``claim`` lets go of ``handle``; with ``give_up`` the request goes too (cancelled if
        unfinished). Never blocks: applied now if the lock is free, else by the next operation."""
        self._departures.append((handle, claim, give_up))
        if self.lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self.lock.release()

    def give_up(self, request_id: int, keep_response: bool = False) -> None:
        """The caller no longer wants the request: cancelled if unfinished, released once it is
        finished and nobody is attached. With ``keep_response`` it is only cancelled: its
        response stays to be taken, as any finished one does (within ``max_unclaimed``)."""
        with self.lock:
            self._reap()
            handle = self._handles.get(request_id)
            if handle is None or handle.given_up:
                return
            if not keep_response:
                self._give_up(handle)
            elif not handle.finished:
                self._cancelled.add(request_id)

    def take_event(self, handle: Handle) -> StreamEvent | None:
        """Hand the next event over (call under the lock); the final one releases the handle."""
        if not handle.events:
            return None
        event = handle.events.popleft()
        if event.finished:
            self._drop(handle)
        return event

    def take_response(self, handle: Handle) -> Response | None:
        """Hand the response over once there is one (call under the lock), releasing the handle."""
        if handle.response is not None:
            self._drop(handle)
        return handle.response

    def arm(self, handle: Handle) -> Waker:
        """A fresh waker for the async consumer of ``handle`` (call under the lock). A waker left
        behind by a finished wait is harmless: waking it sets an event nobody waits on."""
        handle.waker = Waker()
        return handle.waker

    # ---- the engine ---------------------------------------------------------------------------

    def publish(self, handle: Handle, event: StreamEvent, response: Response | None = None) -> None:
        """Leave ``event`` (and, at the end, ``response``) for the consumer and wake it; a routed
        request's event goes to its outbox (held until the round ends, in a round)."""
        route = handle.route
        with self.lock:
            self._reap()
            if route is not None:
                if response is not None:
                    self._cancelled.discard(handle.request_id)
                    self._drop(handle)
                if self._batch is not None:
                    self._routed.setdefault(route.outbox, []).append((route.key, event))
                    return
            else:
                handle.events.append(event)
                if response is not None:
                    handle.response = response
                    self._cancelled.discard(handle.request_id)
                    if handle.consumer is None:
                        self._settle(handle)
                self._wake(handle)
        if route is not None:
            route.outbox([(route.key, event)])

    @contextlib.contextmanager
    def wakes_batched(self) -> Iterator[None]:
        """Hold the async consumers' wakeups and the routed events until the block ends (the
        engine's round), then call each outbox once and schedule one callback per event loop
        setting every waker held; thread consumers are notified at once, as ever."""
        with self.lock:
            self._batch = {}
        try:
            yield
        finally:
            with self.lock:
                batch, self._batch = self._batch, None
                routed, self._routed = self._routed, {}
            for outbox, events in routed.items():
                outbox(events)
            for call_soon, sets in (batch or {}).items():
                _schedule(call_soon, functools.partial(_set_all, list(sets.values())))

    def pop_cancelled(self) -> list[Handle]:
        """Unfinished requests given up since the last call, for the engine to cancel."""
        with self.lock:
            self._reap()
            handles = [self._handles[i] for i in self._cancelled if i in self._handles]
            self._cancelled.clear()
            return handles

    def set_worker_live(self, live: bool) -> None:
        """Record whether a worker runs the loop; when it stops, wake every consumer, so those
        waiting on it drive the loop themselves."""
        with self.lock:
            self._reap()
            self.worker_live = live
            for handle in self._handles.values():
                self._wake(handle)

    def stats(self) -> RequestStats:
        with self.lock:
            self._reap()
            handles = list(self._handles.values())
            unclaimed = len(self._unclaimed)
        unfinished = sum(not h.finished for h in handles)
        attached = sum(h.consumer is not None for h in handles)
        return RequestStats(len(handles), unfinished, unclaimed, attached)

    # ---- under the lock -----------------------------------------------------------------------

    def _reap(self) -> None:
        """Apply the departures ``detach`` queued."""
        while self._departures:
            handle, claim, give_up = self._departures.popleft()
            if handle.consumer is not claim:
                continue
            handle.consumer = handle.waker = None
            if give_up:
                self._give_up(handle)
            elif handle.finished and self._handles.get(handle.request_id) is handle:
                self._settle(handle)

    def _give_up(self, handle: Handle) -> None:
        handle.given_up = True
        if not handle.finished:
            self._cancelled.add(handle.request_id)
        elif handle.consumer is None:
            self._drop(handle)

    def _wake(self, handle: Handle) -> None:
        handle.changed.notify_all()
        waker = handle.waker
        if waker is None:
            return
        if self._batch is None:
            waker.wake()
        else:
            self._batch.setdefault(waker.call_soon, {})[id(waker.event)] = waker.event.set  # held: ids stay unique

    def _settle(self, handle: Handle) -> None:
        """A finished request nobody is attached to: release it if given up, else retain it."""
        if handle.given_up:
            return self._drop(handle)
        self._unclaimed[handle.request_id] = None
        while len(self._unclaimed) > self.max_unclaimed:
            oldest, _ = self._unclaimed.popitem(last=False)
            self._handles.pop(oldest, None)
            log.debug("released the unclaimed response of request %d (max_unclaimed=%d)", oldest, self.max_unclaimed)

    def _drop(self, handle: Handle) -> None:
        if self._handles.get(handle.request_id) is handle:
            del self._handles[handle.request_id]
        self._unclaimed.pop(handle.request_id, None)
