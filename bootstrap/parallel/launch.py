"""Start N ranks on this machine, as ``torchrun --nproc-per-node N`` would, and wait for them.

Each rank is a fresh (spawned) Python process running ``target(*args)`` with the launcher's
contract in its environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
(127.0.0.1) and ``MASTER_PORT`` (a free port). The launcher waits for all of them; once one exits
with an error, the others get ``grace_s`` to finish (their collectives time out and report which
rank stopped answering), then are terminated. No rank outlives ``launch``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

TERMINATE_WAIT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(target: Callable[..., int | None], args: tuple[Any, ...], world_size: int, *, grace_s: float) -> list[int]:
    """Run ``target(*args)`` on ``world_size`` ranks; their exit codes, by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=_rank_main, args=(target, args, r, world_size, port), name=f"rank-{r}")
             for r in range(world_size)]  # fmt: skip
    try:
        for process in ranks:
            process.start()
        _wait(ranks, grace_s)
    finally:
        _stop(ranks)
    return [p.exitcode if p.exitcode is not None else 1 for p in ranks]


def _rank_main(target: Callable[..., int | None], args: tuple[Any, ...], rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    sys.exit(target(*args) or 0)


def _wait(ranks: list[Any], grace_s: float) -> None:
    """Until every rank ended, or ``grace_s`` after the first one failed."""
    running, deadline = list(ranks), None
    while running:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        wait([p.sentinel for p in running], timeout=left)
        running = [p for p in running if p.exitcode is None]
        if deadline is None and any(p.exitcode for p in ranks):
            deadline = time.monotonic() + grace_s


def _stop(ranks: list[Any]) -> None:
    for process in ranks:
        if process.is_alive():
            process.terminate()
    for process in ranks:
        if process.pid is None:
            continue
        process.join(TERMINATE_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()
