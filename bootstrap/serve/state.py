"""What the server knows: the bootstrap's phase, the executor once ready, requests in flight.

One ``ServeState`` per app. Everything here runs on the event loop; the executor is only
reached through the engine channel (``bootstrap.engine.executor.channel``): ``executor`` is its client, whose
core sits beside the started executor (``serve_executor``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import anyio

from bootstrap.api.factory import factory_parts
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline.process import ProcessTimeline
from bootstrap.serve.status.recent import RecentRequests

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from bootstrap.api import Bootstrap
    from bootstrap.api.operation_terms import OtherRanks
    from bootstrap.backends.base import Backend, Executor
    from bootstrap.engine.executor.channel.client import EngineClient  # zmq: with the first executor
    from bootstrap.engine.executor.channel.local import LocalEngine
    from bootstrap.pipeline.events import StageEvent
    from bootstrap.pipeline.process import Phase as ProcessPhase
    from bootstrap.serve.startup.remote import RemoteBootstrap, RemoteEngine
    from bootstrap.serve.startup.spawn import EngineSpawn

Phase = Literal[
    "starting",
    "bootstrapping",
    "ready",
    "failed",
    "shutting_down",
    "idle",  # serve --idle: no model until a swap
    "swapping",
    "updating_weights",
    "sleeping",
    "asleep",
    "waking",
]
OPERATING: dict[str, Phase] = {"swap": "swapping", "weights": "updating_weights", "sleep": "sleeping", "wake": "waking"}


@dataclass(frozen=True)
class ServeOptions:
    """The serve command's choices that are not part of the bootstrap config; ``api_key`` is
    kept without its surrounding whitespace (``clean_api_key``)."""

    model_id: str
    api_key: str | None = None
    trace_file: Path | None = None
    otlp: bool = False
    request_trace_ratio: float = 1.0  # of the requests that come without a trace context, those traced
    backend_factory: str | None = None  # "module:callable"; None: the backend config.backend names
    shutdown_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0  # requests in flight before an operation releases the model
    engine_timeout_s: float = 60.0  # requests waiting on an engine that sends nothing this long: /health 503
    idle: bool = False  # start without a model (``serve --idle``)
    host: str | None = None  # the bound address; a loopback one refuses other sites (``serve.auth``)
    allowed_origins: tuple[str, ...] = ()  # browser origins taken anyway (``parse_origins``)
    allow_open_operations: bool = False  # live operations without a key on an address other than loopback
    engine_process: bool = False  # the engine in a process of its own (``serve``'s default; ``startup.remote``)
    log_level: str = "info"  # the engine's process logs at it too

    def __post_init__(self) -> None:
        if self.api_key is not None:
            object.__setattr__(self, "api_key", clean_api_key(self.api_key))
        object.__setattr__(self, "allowed_origins", tuple(check_origin(o) for o in self.allowed_origins))
        if self.backend_factory is not None:
            factory_parts(self.backend_factory)
        ratio = self.request_trace_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
            raise ConfigError(
                f"request_trace_ratio: must be a number in [0, 1] (got {ratio!r}); 0 traces only "
                "requests whose caller's traceparent is sampled, 1 every request"
            )

    @property
    def traces(self) -> bool:
        """Whether spans go anywhere (a trace file or OTLP): requests are traced only then."""
        return self.trace_file is not None or self.otlp


ORIGIN = re.compile(r"(https?)://([a-z0-9.-]+|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?", re.IGNORECASE | re.ASCII)


def parse_origins(text: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated origins, each checked (``check_origin``)."""
    return () if text is None else tuple(check_origin(part.strip()) for part in text.split(","))


def check_origin(origin: str) -> str:
    """``origin`` as a browser sends it (``scheme://host[:port]``, lower case); ``ConfigError``
    for anything else, a path or a trailing ``/`` included: no browser sends those."""
    found = ORIGIN.fullmatch(origin)
    if found is None or (found.group(3) is not None and not 0 < int(found.group(3)) <= 65535):
        raise ConfigError(
            f"allowed_origins: {origin!r} is not an origin (allowed: comma-separated scheme://host[:port], "
            "scheme http or https, port in [1, 65535], no path, e.g. http://localhost:3000)"
        )
    return origin.lower()


def clean_api_key(key: str) -> str:
    """``key`` without surrounding whitespace: a key file's newline, an env file's CR or spaces,
    which no client sends. ``ConfigError`` when nothing is left, or for a control character
    inside, which no HTTP header can carry: either key could never match."""
    stripped = key.strip()
    if not stripped:
        raise ConfigError("api_key: must not be empty or only whitespace (--api-key or BOOTSTRAP_API_KEY)")
    control = next((c for c in stripped if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if control is not None:
        raise ConfigError(
            f"api_key: must not contain control characters such as {control!r} inside it "
            "(no HTTP header carries them); allowed: printable characters"
        )
    return stripped


class Changes:
    """Wake every waiter on the next change (stage event or phase); nothing polls."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def next(self) -> anyio.Event:
        """The event the *next* change sets; take it before reading the state it guards."""
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()


class Inflight:
    """Request ids running in the executor, and a wait for none to be left."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._idle = anyio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._ids))

    def add(self, request_id: int) -> None:
        if not self._ids:
            self._idle = anyio.Event()
        self._ids.add(request_id)

    def discard(self, request_id: int) -> None:
        self._ids.discard(request_id)
        if not self._ids:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


@dataclass
class ServeState:
    config: BootstrapConfig
    options: ServeOptions
    phase: Phase = "starting"
    boot: Bootstrap | RemoteBootstrap | None = (
        None  # made off the event loop (it imports torch), or the engine's process
    )
    executor: EngineClient | None = None  # the channel to the started executor once ready (``serve_executor``)
    max_seq_len: int | None = None
    model_id: str = ""  # the id clients send: options.model_id, then a swap's
    time_to_ready_s: float | None = None
    error: str | None = None
    failure: BaseException | None = None  # the StageFailed a retry can resume from
    fatal: BaseException | None = None  # the server could not even start its bootstrap
    started_at: float = field(default_factory=time.monotonic)
    inflight: Inflight = field(default_factory=Inflight)
    recent: RecentRequests = field(default_factory=RecentRequests)  # answered lately, for the status page
    tokens_generated: int = 0  # since the server started, counted as each token is streamed
    changes: Changes = field(default_factory=Changes)
    stopping: anyio.Event = field(default_factory=anyio.Event)
    build_scope: anyio.CancelScope | None = None  # the running build or retry, cancelled at shutdown
    process: ProcessTimeline | None = None  # the command's timeline: serving and draining are its phases
    make_backend: Callable[[BootstrapConfig], Backend] | None = None  # rank 0 of --tp N: joins the ranks
    ranks: OtherRanks | None = None  # rank 0 of --tp N: the lockstep, told of operations and the stop
    _process_phase: ProcessPhase | None = field(default=None, init=False, repr=False)  # the phase track_process began
    stall_logged: bool = False  # the engine's current stall is in the log (``/health``)
    engine_spawn: EngineSpawn | None = None  # the engine's process, started by the command before its imports
    _engine: LocalEngine | RemoteEngine | None = field(default=None, init=False, repr=False)  # ``executor``'s channel

    def __post_init__(self) -> None:
        self.model_id = self.model_id or self.options.model_id

    def set_phase(self, phase: Phase, error: str | None = None, since_ns: int | None = None) -> None:
        """``since_ns``: when the phase began where it began (the engine's process finished a
        build): the process's ``serving`` phase starts there, the channel's connection in it."""
        if self.phase == "shutting_down":  # final: a late bootstrap result does not undo it
            return
        self.phase, self.error = phase, error
        if phase in ("ready", "failed", "shutting_down", "idle", "asleep"):  # the server answers from here on
            self.track_process("draining" if phase == "shutting_down" else "serving", since_ns)
        self.changes.notify()

    def engine_stall(self) -> str | None:
        """What ``/health`` says when requests have waited ``engine_timeout_s`` on an engine that
        sent nothing since (a step that never ends); None while it answers."""
        silent_s, waiting = self.executor.silent_s() if self.executor is not None else (0.0, 0)
        if silent_s < self.options.engine_timeout_s:
            return None
        return (
            f"engine: no step has answered for {silent_s:.0f} s while {waiting} request(s) wait on it "
            f"(--engine-timeout {self.options.engine_timeout_s:g})"
        )

    def serve_executor(self, executor: Executor | None, error: str | None = None) -> None:
        """Serve ``executor`` (a started ``PyExecutor``: ``serve`` runs the native backend; or the
        engine's process's ``Served`` channel) through a channel of its own, or none; the previous
        channel is closed first, its requests ended (with ``error``, an error each)."""
        if executor is not None and self._engine is not None and self._engine.executor is executor:
            return
        if self._engine is not None:
            engine, self._engine, self.executor = self._engine, None, None
            engine.close(error)
        if executor is None:
            return
        remote = getattr(self.boot, "channel", None)  # ``RemoteBootstrap``: the engine's process
        if remote is not None:
            self._engine = remote(executor)
        else:
            from bootstrap.engine.executor.channel.local import LocalEngine  # imports torch, as the executor did

            self._engine = LocalEngine(executor)  # type: ignore[arg-type]
        self.executor = self._engine.start()

    def track_process(self, name: str | None, since_ns: int | None = None) -> None:
        """End the process phase in progress and (``name``) begin the next one (at ``since_ns``
        when none was in progress: no two phases overlap)."""
        if self.process is None:
            return
        if self._process_phase is not None:
            self.process.finish(self._process_phase)
            since_ns = None
        self._process_phase = self.process.begin(name, since_ns) if name is not None else None

    def tracer(self) -> Tracer | None:
        """The trace pipeline's tracer for request spans; None when spans go nowhere or the
        bootstrap is not made yet."""
        return self.boot.tracer if self.options.traces and self.boot is not None else None

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    def stage_events_since(self, cursor: int) -> tuple[list[StageEvent], int]:
        """The stage events after ``cursor`` and the cursor after them (``EventHub.since``)."""
        return ([], cursor) if self.boot is None else self.boot.hub.since(cursor)

    def stage_history(self) -> list[StageEvent]:
        """The stage events of every pipeline the bootstrap ran (its hub; the newest it keeps), oldest first."""
        return [] if self.boot is None else self.boot.hub.history

    def cut_short(self) -> int:
        """Cancel every request in flight in the executor now; how many. Each one's handler then
        ends by itself (a stream with its ``abort`` chunk and ``[DONE]``), so nothing is torn down
        mid-send: a drain's end, the grace period's end and a second SIGINT all use it."""
        left = list(self.inflight)
        if self.executor is not None:
            for request_id in left:
                self.executor.cancel(request_id)
        return len(left)

    def begin_shutdown(self) -> None:
        """Called once per signal: stop taking requests; the drain task does the rest."""
        self.set_phase("shutting_down", self.error)
        self.stopping.set()
