"""One dedicated worker thread per device, awaited without blocking the event loop.

All blocking device work (weight loading, allocations, forwards, releases) goes through the
same thread, so it runs in order on one CUDA context and the event loop stays free for health
probes. A cancelled await still waits for the work in flight: a thread cannot be interrupted,
and rollback must not race it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


class DeviceThread:
    def __init__(self, name: str = "bootstrap-device") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._executor.submit(fn, *args)
        return await anyio.to_thread.run_sync(future.result)

    def close(self) -> None:
        """Stop the thread, blocking until the work in flight ends: for a thread with none left
        (after a finished run); from async code with work that may still run, use ``aclose``."""
        self._executor.shutdown(wait=True)

    async def aclose(self) -> None:
        """Let the work already submitted finish, then stop the thread (the event loop stays free)."""
        await anyio.to_thread.run_sync(self._executor.shutdown)
