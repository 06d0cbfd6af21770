"""How another thread reaches the running event loop (asyncio or trio): the executor's wakers and
the engine channel's client both schedule their callbacks through it. Torch-free."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def call_soon_threadsafe() -> Callable[..., object]:
    """How another thread schedules a callback on the running event loop (asyncio or trio)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: trio, anyio's other backend
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
