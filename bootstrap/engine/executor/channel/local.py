"""``LocalEngine``: a started executor in this process behind the channel, both ends wired."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from bootstrap.engine.executor.channel.client import EngineClient
from bootstrap.engine.executor.channel.engine_side import EngineCore
from bootstrap.engine.executor.py_executor import PyExecutor


class LocalEngine:
    """The ``client`` the server reads and the ``core`` beside ``executor``, on one ZeroMQ context
    of their own (``inproc`` sockets). ``start`` on the event loop that reads the client."""

    def __init__(self, executor: PyExecutor, clock: Callable[[], float] = time.monotonic) -> None:
        self.executor = executor
        self._context = zmq.Context()
        stats = executor.engine_stats()
        self.client = EngineClient(self._context, executor.tokenizer, executor.runner.vocab_size, stats, clock)
        self.core = EngineCore(executor, self._context, *self.client.addresses)

    def start(self) -> EngineClient:
        self.client.start()
        self.core.start()
        return self.client

    def close(self, error: str | None = None) -> None:
        """Both ends stopped and the context ended (idempotent); the executor stays as it is."""
        self.core.close()
        self.client.close(error)
        self._context.term()
