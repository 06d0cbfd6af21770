"""``Receiver``: a thread that reads one ZeroMQ socket until it is stopped; both ends use one."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq

log = logging.getLogger("bootstrap.engine.executor.channel")


class Receiver:
    """Calls ``handle(frame)`` for each frame ``socket`` receives, on a thread of its own, until
    ``stop``; the socket is then closed by that thread, its only user after ``start``."""

    def __init__(self, context: zmq.Context, socket: zmq.Socket, handle: Callable[[bytes], None], name: str) -> None:
        self._socket, self._handle = socket, handle
        self._address = f"inproc://bootstrap-stop-{uuid.uuid4().hex}"
        self._stopper = context.socket(zmq.PAIR)
        self._stopper.bind(self._address)
        self._thread = threading.Thread(target=self._run, args=(context,), name=name, daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Wake the thread, wait for it to end (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            self._stopper.send(b"")
            self._thread.join()
        else:
            self._socket.close()
        self._stopper.close()

    def _run(self, context: zmq.Context) -> None:
        wake = context.socket(zmq.PAIR)
        wake.connect(self._address)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while wake not in dict(poller.poll()):
                frame = self._socket.recv()
                try:
                    self._handle(frame)
                except Exception:  # a frame that cannot be read is a bug on one side: say so, read on
                    log.exception("%s: a frame could not be handled", self._thread.name)
        finally:
            wake.close()
            self._socket.close()
