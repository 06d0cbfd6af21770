"""Start N ranks on this machine with torch's own launcher, and wait for them.

``launch`` is ``torchrun --nproc-per-node N`` as a function: torchrun's elastic agent
(``elastic_launch``) with its single-machine settings, so the ranks get torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, ...) and the agent's handling of
signals and failures: a stop signal to the launcher reaches every rank (killed after
``SHUTDOWN_S``); a rank that fails stops the others, nothing restarts; the launcher killed outright
gives each rank SIGINT (the parent-death signal). Each rank has a session of its own, so a
terminal's Ctrl-C reaches the launcher alone. No rank outlives ``launch``.

The rendezvous is static, on a store this process holds on 127.0.0.1 alone (``loopback_store``:
torch's ``TCPStore`` server listens on every interface whatever host it is given, and asks
nobody who connects); the agent and the ranks (``MASTER_ADDR`` 127.0.0.1) share it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

SHUTDOWN_S = 30  # torchrun's default: how long stopped ranks get before SIGKILL
LOOPBACK = "127.0.0.1"
AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@dataclass(frozen=True)
class Launched:
    """How the ranks ended. ``codes``: the exit status of each rank the agent saw end (a negative
    status is the signal that killed it; a rank the agent stopped after another's failure is not
    in it). ``signal``: the signal that stopped the launcher, if one did. ``raised``: the last
    line of an exception that escaped a rank, by rank."""

    codes: dict[int, int]
    signal: int | None = None
    raised: dict[int, str] = field(default_factory=dict)


def launch(target: Callable[..., int | None], args: tuple[Any, ...], world_size: int) -> Launched:
    """Run ``target(*args)`` on ``world_size`` ranks, each a spawned process, until they end."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="bootstrap-ranks-") as logs, _agent_scope(), loopback_store() as port:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=uuid.uuid4().hex,
            rdzv_backend="static",
            rdzv_endpoint=f"{LOOPBACK}:{port}",
            rdzv_configs={"rank": 0},
            max_restarts=0,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=logs),
            **_shutdown_timeout(LaunchConfig),
        )
        try:
            returned = elastic_launch(config, _rank_main)(target, args)
        except ChildFailedError as exc:
            return Launched(
                {r: f.exitcode for r, f in exc.failures.items()},
                raised={r: _last_line(f.message) for r, f in exc.failures.items() if os.path.isfile(f.error_file)},
            )
        except SignalException as exc:
            return Launched({}, signal=int(exc.sigval))
    return Launched({rank: int(code or 0) for rank, code in returned.items()})


def _rank_main(target: Callable[..., int | None], args: tuple[Any, ...]) -> int:
    """One rank: a session of its own (as torchrun's subprocess ranks), then ``target``; a
    non-zero status is the process's exit status."""
    os.setsid()
    code = target(*args) or 0
    if code:
        sys.exit(code)
    return 0


@contextlib.contextmanager
def loopback_store() -> Iterator[int]:
    """A store server on a free port of 127.0.0.1 alone, for as long as the block runs; its port.
    It serves the rendezvous: torch's static rendezvous asks for a multi-tenant store on that port
    and gets this one (one server per port and process) instead of a new one on every interface."""
    from torch.distributed import TCPStore

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = TCPStore(
            LOOPBACK,
            port,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=listener.fileno(),
        )
        listener.detach()  # the store's server owns the socket (and closes it) from here on
    try:
        yield port
    finally:
        del store


@contextlib.contextmanager
def _agent_scope() -> Iterator[None]:
    """What the agent changes in this process, put back when it is done: its signal handlers,
    the environment it sets for the ranks, and torch's log lines (``launch``'s caller reports)."""
    handlers = {sig: signal.getsignal(sig) for sig in AGENT_SIGNALS}
    environ = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE")}
    loggers = {name: logging.getLogger(name).level for name in _torch_loggers()}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks on one machine
    for name in loggers:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key, value in environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for name, level in loggers.items():
            logging.getLogger(name).setLevel(level)


def _torch_loggers() -> list[str]:
    """The agent's loggers and their children (torch sets a level on each of them)."""
    names = set(logging.root.manager.loggerDict) | set(TORCH_LOGGERS)
    return sorted(n for n in names if n.startswith(TORCH_LOGGERS))


def _last_line(message: Any) -> str:
    """The last line of the traceback torch's error file holds (a string, or a dict holding one)."""
    text = message.get("message", "") if isinstance(message, dict) else message
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "an exception"


def _shutdown_timeout(config_class: type) -> dict[str, float]:
    """``shutdown_timeout=SHUTDOWN_S`` where this torch's ``LaunchConfig`` takes it (newer
    releases); an older one (2.11 has none) keeps its own wait before SIGKILL."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in names else {}
