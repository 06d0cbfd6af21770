"""``EngineClient``: the server's end of the channel, what its routes call instead of the executor.

It names each request (the ids are its own), sends ``Submit`` and ``Cancel``, and keeps each
request's events as the engine's ``Round`` messages bring them: a thread reads the socket and
hands each round to the event loop in one callback, which queues every event and wakes each
request's reader once. ``next_event`` is cancel-safe (a cancelled wait takes nothing);
``forget`` gives a request up, cancelled if unfinished, its later events dropped. ``close``
stops the thread and ends every request still open with a ``cancelled`` final event, so no
reader is left waiting. ``engine_stats`` is the load the latest round carried; ``silent_s``
how long requests have waited on an engine that sent nothing (the server's hang watch).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import zmq

from bootstrap.engine.executor.channel import messages as m
from bootstrap.engine.executor.channel.threads import Receiver
from bootstrap.engine.executor.event_loops import call_soon_threadsafe
from bootstrap.engine.executor.stats import EngineStats
from bootstrap.engine.request.prompts import token_id_problem
from bootstrap.engine.request.stream_event import StreamEvent, rejected
from bootstrap.engine.sampling.params import SamplingParams
from bootstrap.engine.spec.counts import SpeculationStats

CLOSED = "the engine's channel closed before the request ended"


@dataclass(eq=False)
class _Request:
    events: deque[StreamEvent] = field(default_factory=deque)
    wake: anyio.Event | None = None  # set when events arrive for a reader waiting on it
    forgotten: bool = False  # nobody reads it: its events are dropped, it goes at its final one


class EngineClient:
    """Requests to one engine over ``addresses`` (commands, rounds; inproc ones by default, ``ipc``
    ones the engine's process names), which it binds; the engine side connects (``EngineCore``).
    ``tokenizer``: the engine's, for the server's prompts and text; ``vocab_size``: prompt ids
    outside it are refused here, as the engine words it (no frame carries an id past 64 bits);
    ``stats``: the engine's load until its first round."""

    def __init__(
        self,
        context: zmq.Context,
        tokenizer: object | None,
        vocab_size: int,
        stats: EngineStats,
        clock: Callable[[], float] = time.monotonic,
        addresses: tuple[str, str] | None = None,
    ) -> None:
        self.tokenizer, self.vocab_size, self._clock = tokenizer, vocab_size, clock
        self._unanswered: set[int] = set()  # submitted, their final event not come yet
        self._heard = clock()  # when the engine last sent a round, or work began after none was waiting
        name = uuid.uuid4().hex
        self.addresses = addresses or (f"inproc://bootstrap-commands-{name}", f"inproc://bootstrap-rounds-{name}")
        self._commands = context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.bind(self.addresses[0])
        rounds = context.socket(zmq.PULL)
        rounds.setsockopt(zmq.RCVHWM, 0)
        rounds.bind(self.addresses[1])
        self._receiver = Receiver(context, rounds, self._received, "bootstrap-client")
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._stats = stats
        self.speculation: SpeculationStats | None = None  # the draft's acceptance, as the latest round left it
        self._call_soon: Callable[..., object] | None = None
        self._open = True

    def start(self) -> None:
        """Begin reading rounds; call it on the event loop that reads the requests."""
        self._call_soon = call_soon_threadsafe()
        self._receiver.start()

    @property
    def is_running(self) -> bool:
        return self._open

    # ---- requests -----------------------------------------------------------------------------

    def enqueue(self, prompt: Sequence[int], params: SamplingParams, *, cache_salt: str | None = None) -> int:
        [request_id] = self.enqueue_choices(prompt, params, 1, cache_salt=cache_salt)
        return request_id

    def enqueue_choices(
        self, prompt: Sequence[int], params: SamplingParams, n: int = 1, *, cache_salt: str | None = None
    ) -> list[int]:
        """The ids of ``n`` choices of ``prompt``, queued; ``RuntimeError`` once closed."""
        if not self._open:
            raise RuntimeError(CLOSED)
        ids = [next(self._ids) for _ in range(n)]
        for request_id in ids:
            self._requests[request_id] = _Request()
        problem = token_id_problem(prompt, self.vocab_size)
        if problem is not None:  # the engine's own answer to such a request
            for request_id in ids:
                self._requests[request_id].events.append(rejected(problem))
            return ids
        self._commands.send(m.encode(m.Submit(ids, list(prompt), params, cache_salt)), copy=False)
        if not self._unanswered:
            self._heard = self._clock()
        self._unanswered.update(ids)
        return ids

    def cancel(self, request_id: int) -> None:
        """End the request early (its final event says ``cancelled``); unknown ids are ignored."""
        if self._open and request_id in self._requests:
            self._commands.send(m.encode(m.Cancel([request_id])), copy=False)

    async def next_event(self, request_id: int) -> StreamEvent:
        """The request's next event, once it came; after its final one the id is unknown
        (``KeyError``). One reader per request."""
        request = self._requests[request_id]
        while not request.events:
            request.wake = anyio.Event()
            await request.wake.wait()
        event = request.events.popleft()
        if event.finished:
            self._requests.pop(request_id, None)
        return event

    async def next_events(self, request_id: int) -> list[StreamEvent]:
        """Every event of the request that has come, once at least one has (its final one last,
        if among them): a reader that fell behind takes the rounds it missed in one wake."""
        request = self._requests[request_id]
        while not request.events:
            request.wake = anyio.Event()
            await request.wake.wait()
        events = list(request.events)
        request.events.clear()
        if events[-1].finished:
            self._requests.pop(request_id, None)
        return events

    def forget(self, request_id: int) -> None:
        """Nobody reads the request any more: cancelled if unfinished, gone at its final event."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if any(event.finished for event in request.events):
            del self._requests[request_id]
            return
        request.forgotten = True
        request.events.clear()
        self.cancel(request_id)

    def engine_stats(self) -> EngineStats:
        """The engine's load as its latest round left it."""
        return self._stats

    def silent_s(self) -> tuple[float, int]:
        """Seconds the engine has sent nothing while requests wait on it, and how many wait;
        (0, 0) when none does."""
        if not self._unanswered:
            return 0.0, 0
        return self._clock() - self._heard, len(self._unanswered)

    def pending(self) -> int:
        """Requests not ended yet (read or not)."""
        return len(self._requests)

    # ---- the rounds ---------------------------------------------------------------------------

    def _received(self, frame: bytes) -> None:
        """The reader thread: one callback on the event loop per round."""
        call_soon = self._call_soon
        if call_soon is not None:
            with contextlib.suppress(RuntimeError):  # its event loop has ended: nobody reads these
                call_soon(self._dispatch, m.decode_round(frame))

    def _dispatch(self, round_: m.Round) -> None:
        self._stats, self.speculation, self._heard = round_.stats, round_.speculation, self._clock()
        requests = self._requests
        for request_id, event in round_.events:
            if event.finished:
                self._unanswered.discard(request_id)
            request = requests.get(request_id)
            if request is None:
                continue
            if request.forgotten:
                if event.finished:
                    del requests[request_id]
                continue
            request.events.append(event)
            if request.wake is not None:
                request.wake.set()
                request.wake = None

    def close(self, error: str | None = None) -> None:
        """Stop reading, close the sockets, end every open request (idempotent; on the event loop):
        ``cancelled``, or with ``error`` (the engine's process is gone) an ``error`` final event."""
        if not self._open:
            return
        self._open = False
        self._receiver.stop()
        self._commands.close()
        self._unanswered.clear()
        for request_id, request in list(self._requests.items()):
            if request.forgotten:
                del self._requests[request_id]
                continue
            request.events.append(
                StreamEvent(None, "", "error", error) if error else StreamEvent(None, "", "cancelled", CLOSED)
            )
            if request.wake is not None:
                request.wake.set()
