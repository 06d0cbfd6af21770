"""``EngineCore``: the engine's end of the channel, next to a started ``PyExecutor``.

A command thread takes ``Submit`` and ``Cancel`` from the server's socket and calls the executor;
the requests are routed (``request_table.Route``), so every event a round publishes reaches
``_deliver`` in one call, on the executor's thread, and leaves as one ``Round``. The server's
ids name the requests on the wire; the executor's own stay here. ``close`` stops the thread and
closes both sockets; events published after it (a shutdown's cancellations) are dropped.
"""

from __future__ import annotations

import threading

import zmq

from bootstrap.engine.executor.channel import messages as m
from bootstrap.engine.executor.channel.threads import Receiver
from bootstrap.engine.executor.py_executor import PyExecutor
from bootstrap.engine.request.stream_event import StreamEvent, rejected


class EngineCore:
    """Serves one executor's requests over ``commands`` (read) and ``rounds`` (written): the
    addresses the client bound (``EngineClient.addresses``)."""

    def __init__(self, executor: PyExecutor, context: zmq.Context, commands: str, rounds: str) -> None:
        self.executor = executor
        self._lock = threading.Lock()  # the rounds socket (two threads publish) and the id maps
        self._engine_ids: dict[int, int] = {}  # the server's id -> the executor's, until its final event
        self._ended_early: set[int] = set()  # final events delivered before their submit returned
        self._rounds = context.socket(zmq.PUSH)
        self._rounds.setsockopt(zmq.LINGER, 0)
        self._rounds.setsockopt(zmq.SNDHWM, 0)  # never blocks the engine's thread: the client reads every round
        self._rounds.connect(rounds)
        commands_socket = context.socket(zmq.PULL)
        commands_socket.setsockopt(zmq.LINGER, 0)
        commands_socket.connect(commands)
        self._commands = Receiver(context, commands_socket, self._apply_frame, "bootstrap-core")
        self._open = True

    def start(self) -> None:
        """Start the command thread and send the engine's load (the client's first ``Round``)."""
        self._commands.start()
        self._deliver([])

    def close(self) -> None:
        """Stop the command thread and close the sockets (idempotent); the executor stays as it is."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        self._commands.stop()
        with self._lock:
            self._rounds.close()

    # ---- the command thread -------------------------------------------------------------------

    def _apply_frame(self, frame: bytes) -> None:
        self._apply(m.decode_command(frame))

    def _apply(self, command: m.ToEngine) -> None:
        if isinstance(command, m.Cancel):
            with self._lock:
                ids = [self._engine_ids.get(key) for key in command.request_ids]
            for request_id in ids:
                if request_id is not None:
                    self.executor.cancel(request_id)
            return
        keys = command.request_ids
        try:
            ids = self.executor.enqueue_choices(
                command.prompt,
                command.params,
                len(keys),
                cache_salt=command.cache_salt,
                outbox=self._deliver,
                keys=keys,
            )
        except (TypeError, ValueError, RuntimeError) as exc:  # the server checked it: a bug, or shut down
            self._deliver([(key, rejected(exc)) for key in keys])
            with self._lock:
                self._ended_early.difference_update(keys)
            return
        with self._lock:
            for key, request_id in zip(keys, ids):
                if key in self._ended_early:
                    self._ended_early.discard(key)
                else:
                    self._engine_ids[key] = request_id

    # ---- the executor's side ------------------------------------------------------------------

    def _deliver(self, events: list[tuple[int, StreamEvent]]) -> None:
        """The executor's outbox: one ``Round`` with ``events`` and the load after them."""
        speculator = self.executor.speculator
        speculation = speculator.stats if speculator is not None else None
        frame = m.encode(m.Round(events, self.executor.engine_stats(), speculation))
        with self._lock:
            for key, event in events:
                if event.finish_reason is not None and self._engine_ids.pop(key, None) is None:
                    self._ended_early.add(key)
            if self._open:
                self._rounds.send(frame, copy=False)
