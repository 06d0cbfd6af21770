"""A started executor the caller owns (``build_executor``) or borrows (``executor``)."""

from __future__ import annotations

import atexit
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from bootstrap.api.boot import Bootstrap, BootstrapReport
from bootstrap.backends.base import Executor, ShutsDownAtExit
from bootstrap.config import BootstrapConfig


async def build_executor(config: BootstrapConfig, **options: Any) -> tuple[Executor, BootstrapReport]:
    """Build and start an executor; the caller owns it (``executor.shutdown()`` releases its KV
    pool and worker; weights go with the last reference). On failure nothing is left allocated."""
    boot = Bootstrap(config, **options)
    try:
        await boot.build()
    except BaseException:
        await boot.aclose()
        raise
    executor, report = boot.detach()
    shut_down_at_exit(executor)
    return executor, report


def shut_down_at_exit(executor: Executor) -> None:
    """A program that ends without ``shutdown`` must not abort on a worker thread still in a
    torch call as the interpreter finalizes: the native ``PyExecutor`` guards itself (an
    ``atexit`` hook from its worker's start to its ``shutdown``); any other backend's executor
    gets a hook here, holding it weakly so that its weights still go with the last reference."""
    if not (isinstance(executor, ShutsDownAtExit) and executor.shuts_down_at_exit):
        atexit.register(_shut_down_if_running, weakref.ref(executor))


def _shut_down_if_running(ref: weakref.ref[Executor]) -> None:
    executor = ref()
    if executor is not None and executor.is_running:
        executor.shutdown()


@asynccontextmanager
async def executor(config: BootstrapConfig, **options: Any) -> AsyncIterator[Executor]:
    """``async with executor(config) as ex``: a started executor, everything released on exit."""
    boot = Bootstrap(config, **options)
    try:
        yield await boot.build()
    finally:
        await boot.aclose()
