"""``RemoteBootstrap``: the server's ``Bootstrap`` when the engine runs in a process of its own.

It answers what the routes read (stages, plan, operations, report, events) from the latest
``Snapshot`` the engine's process sent (``control``), and runs ``build``, ``retry``, the live
operations and ``aclose`` there as calls, a drain asked back by the engine run here. Each
call's end carries the executor's channel (``Served``), which ``channel`` opens as the server's
``EngineClient``. A cancelled call is abandoned there and waited for (its stages roll back). The
engine's spans join this process's trace file; its exit, unless asked for, is ``on_death``.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import anyio

from bootstrap.api import control as c
from bootstrap.api.boot import BootstrapReport
from bootstrap.api.operation_terms import Busy, OperationRecord, Refused, Reverted
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.engine.executor.channel.client import EngineClient
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.events import EventHub, StageEvent, StageStatus
from bootstrap.pipeline.process import ProcessTimeline
from bootstrap.pipeline.telemetry import TRACER_NAME, JsonLinesSpanExporter, make_tracer_provider
from bootstrap.serve.startup.spawn import EngineSpawn

log = logging.getLogger("bootstrap.serve")
Drain = Callable[[], Awaitable[None]]


class EngineDied(RuntimeError):
    """The engine's process exited without being asked to: the server exits 1."""

    exit_status = 1


REBUILT = {"Reverted": Reverted, "Refused": Refused, "Busy": Busy, "ConfigError": ConfigError, "EngineDied": EngineDied}


class RemoteError(Exception):
    """An exception of the engine's process, under its own type's name and module."""


@cache
def _remote_type(module: str, name: str) -> type[RemoteError]:
    return type(name, (RemoteError,), {"__module__": module})


def rebuilt(failure: c.Failure) -> BaseException:
    """The exception the server acts on, its causes chained as the engine's were."""
    cause: BaseException | None = None
    for module, name, text in reversed(failure.causes):
        inner = _remote_type(module, name)(text)
        inner.__cause__, cause = cause, inner
    if failure.kind == "StageFailed":
        return StageFailed(failure.stage or "?", failure.attempts, cause or RemoteError(failure.text), failure.advice)
    kind = REBUILT.get(failure.kind)
    exc = kind(failure.text) if kind is not None else _remote_type("bootstrap.engine", failure.type_name)(failure.text)
    exc.__cause__ = cause
    return exc


@dataclass(eq=False)
class _Call:
    method: str
    drain: Drain | None
    notes: list[c.Reply | c.DrainAsk] = field(default_factory=list)
    heard: anyio.Event = field(default_factory=anyio.Event)


class RemoteEngine:
    """The server's end of one ``Served`` channel (``ServeState.serve_executor``)."""

    def __init__(self, boot: RemoteBootstrap, served: c.Served) -> None:
        self.executor, self._boot = served, boot
        tokenizer = (
            pickle.loads(served.tokenizer) if served.tokenizer is not None else None
        )  # our own process's, over a private socket
        context = boot.spawn.context
        self.client = EngineClient(context, tokenizer, served.vocab_size, served.stats, addresses=served.addresses)

    def start(self) -> EngineClient:
        self.client.start()
        return self.client

    def close(self, error: str | None = None) -> None:
        self.client.close(error)
        self._boot.spawn.send(c.Unserve(self.executor.core))


class RemoteBootstrap:
    """What ``ServeState.boot`` is when the engine runs in its own process (``start``)."""

    def __init__(self, process: ProcessTimeline | None, file: JsonLinesSpanExporter | None, otlp: bool) -> None:
        self.process, self._file = process, file
        self._provider = make_tracer_provider(file=file, otlp=otlp, requests=True)
        self.tracer = self._provider.get_tracer(TRACER_NAME)
        if process is not None:
            process.attach(self.tracer)
        self.hub = EventHub()
        self._snapshot = c.Snapshot(None, 0, False, [], {}, [])
        self._report: dict[str, Any] | None = None
        self._served: c.Served | None = None
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self._calling: str | None = None
        self._closing = False
        self._killed = False
        self.ready_ns: int | None = None  # when the latest call's work ended in the engine's process
        self.patience_s = 60.0  # how long an abandoned call or the close may go unanswered (``--engine-timeout``)
        self._hello = anyio.Event()
        self._fatal: BaseException | None = None
        self.died: str | None = None
        self.on_death: Callable[[str], None] = lambda text: None
        self.spawn: EngineSpawn

    @classmethod
    async def start(
        cls, config: BootstrapConfig, options: Any, process: ProcessTimeline | None, spawn: EngineSpawn | None = None
    ) -> RemoteBootstrap:
        """Start the engine's process (or take ``spawn``, started earlier) and wait for its
        backend (``Hello``); what it raised instead."""
        boot: RemoteBootstrap | None = None
        try:
            file = JsonLinesSpanExporter(options.trace_file) if options.trace_file is not None else None
            boot = cls(process, file, options.otlp)
            boot.patience_s = options.engine_timeout_s
            boot.spawn = spawn or EngineSpawn(options.log_level)
        except BaseException:  # an unwritable trace file: the process started for nothing goes
            if spawn is not None:
                await anyio.to_thread.run_sync(spawn.kill)
            if boot is not None:
                boot._close_trace()
            raise
        boot.spawn.listen(boot._noted, boot._exited)
        ids = process.span_ids() if process is not None else None
        start = c.Start(
            config.model_dump(mode="json"),
            options.backend_factory,
            options.otlp,
            file is not None,
            (f"{ids[0]:032x}", f"{ids[1]:016x}") if ids is not None else None,
            boot.spawn.dir,
            list(sys.path),
        )
        try:
            boot.spawn.send(start)
            await boot._hello.wait()
        except BaseException:  # a signal before its backend was made: no stage began, the process goes
            boot._closing = True
            boot.spawn.process.kill()
            with anyio.CancelScope(shield=True):
                await boot._stop()
            boot._close_trace()
            raise
        if boot._fatal is not None:
            await boot._stop()
            boot._close_trace()
            raise boot._fatal
        return boot

    # ---- what the routes read -------------------------------------------------------------------

    @property
    def busy(self) -> str | None:
        return self._calling or self._snapshot.busy

    @property
    def asleep(self) -> int:
        return self._snapshot.asleep

    @property
    def operations(self) -> list[OperationRecord]:
        return self._snapshot.operations

    @property
    def executor(self) -> c.Served | None:
        """The started executor's channel, None while none is started."""
        return self._served if self._snapshot.live and self.died is None else None

    def stage_status(self) -> list[StageStatus]:
        return self._snapshot.status

    def plan(self) -> dict[str, Any]:
        return self._snapshot.plan

    def report(self) -> BootstrapReport:
        report = self._report or {"stages": [], "plan": {}, "trace_id": None, "time_to_ready_s": None}
        return BootstrapReport(**report)

    def events(self) -> AsyncIterator[StageEvent]:
        return self.hub.subscribe()

    def channel(self, served: c.Served) -> RemoteEngine:
        return RemoteEngine(self, served)

    # ---- what runs in the engine's process ---------------------------------------------------

    async def build(self) -> c.Served:
        return await self._call("build")

    async def retry(self, stage_id: str | None = None) -> c.Served:
        return await self._call("retry", stage_id=stage_id)

    async def swap(self, config: BootstrapConfig, *, drain: Drain) -> c.Served:
        return await self._call("swap", drain, config=config.model_dump(mode="json"))

    async def update_weights(self, path: str, *, drain: Drain) -> c.Served:
        return await self._call("update_weights", drain, path=str(path))

    async def sleep(self, level: int, *, drain: Drain) -> None:
        await self._call("sleep", drain, level=level)

    async def wake(self) -> c.Served:
        return await self._call("wake")

    async def aclose(self) -> None:
        """The engine's ``aclose`` (the process's shutdown phase), then its exit; the trace flushed."""
        try:
            with self.process.phase("shutdown") if self.process is not None else contextlib.nullcontext():
                if self.died is None:
                    self._closing = True
                    with anyio.move_on_after(self.patience_s) as waited:
                        with contextlib.suppress(EngineDied):  # it died meanwhile: ``on_death`` said so
                            await self._call("aclose")
                    if waited.cancelled_caught:
                        self._kill_hung("its close")
                await self._stop()
        finally:
            self._close_trace()

    async def _call(self, method: str, drain: Drain | None = None, **args: Any) -> Any:
        if self.died is not None:
            raise EngineDied(self.died)
        call_id, call = self._next_call, _Call(method, drain)
        self._next_call += 1
        self._calls[call_id] = call
        self._calling = self._calling or method
        try:
            self.spawn.send(c.Call(call_id, method, args))
            try:
                reply = await self._answer(call_id, call)
            except anyio.get_cancelled_exc_class():
                self.spawn.send(c.Abandon(call_id))
                with anyio.CancelScope(shield=True):  # its stages roll back there first
                    with anyio.move_on_after(self.patience_s) as waited:
                        await self._answer(call_id, call, drains=False)
                if waited.cancelled_caught:
                    self._kill_hung("its close" if method == "aclose" else f"the cancelled {method}")
                raise
        finally:
            self._calls.pop(call_id, None)
            if self._calling == method:
                self._calling = None
        if reply.failure is not None:
            raise rebuilt(reply.failure)
        return reply.served if self._snapshot.live else None

    async def _answer(self, call_id: int, call: _Call, drains: bool = True) -> c.Reply:
        """The call's reply, running each drain it asks for meanwhile (``drains``; an abandoned
        call's drain is answered at once: its operation is being cancelled there)."""
        while True:
            await call.heard.wait()
            call.heard = anyio.Event()
            while call.notes:
                note = call.notes.pop(0)
                if isinstance(note, c.Reply):
                    return note
                if drains and call.drain is not None:
                    await call.drain()
                self.spawn.send(c.Drained(call_id))

    # ---- what the engine's process says --------------------------------------------------------

    def _noted(self, note: c.FromEngine) -> None:
        """The notes thread: spans go to the file here; the rest to the event loop."""
        if isinstance(note, c.Spans):
            if self._file is not None:
                self._file.write(note.records)
            return
        self.spawn.call_soon(self._on_loop, note)

    def _on_loop(self, note: c.FromEngine) -> None:
        if isinstance(note, c.Fatal):
            self._fatal = rebuilt(note.failure)
            self._hello.set()
            return
        if isinstance(note, c.DrainAsk):
            self._tell(note.call_id, note)
            return
        self._snapshot = note.snapshot
        if isinstance(note, c.Events):
            for event in note.events:
                self.hub.publish(event)
        elif isinstance(note, c.Hello):
            self._report = note.snapshot.report
            self._hello.set()
        elif isinstance(note, c.Reply):
            self._report = note.snapshot.report
            self._served, self.ready_ns = note.served, note.ended_ns or None
            self._tell(note.call_id, note)

    def _tell(self, call_id: int, note: c.Reply | c.DrainAsk) -> None:
        call = self._calls.get(call_id)
        if call is not None:
            call.notes.append(note)
            call.heard.set()

    def _exited(self, status: int, last_line: str) -> None:
        if self._closing and status == 0:
            return
        said = f"; its last line: {last_line.strip()}" if last_line else "; it wrote nothing to stderr"
        self.died = f"the engine's process (pid {self.spawn.pid}) exited with status {status}{said}"
        if not self._hello.is_set():
            self._fatal = EngineDied(self.died)
            self._hello.set()
        for call_id in list(self._calls):
            failure = c.Failure("EngineDied", "EngineDied", self.died)
            self._tell(call_id, c.Reply(call_id, self._snapshot, failure))
        self.on_death(self.died)

    def _kill_hung(self, what: str) -> None:
        """An engine that does not answer: killed, its exit then a death (the server exits 1)."""
        if self.spawn.status is not None or self._killed:
            return
        self._killed, self._closing = True, False
        log.error(
            "bootstrap serve: the engine's process (pid %d) did not answer %s within %g s (--engine-timeout): killed",
            self.spawn.pid,
            what,
            self.patience_s,
        )
        self.spawn.process.kill()

    async def _stop(self) -> None:
        await anyio.to_thread.run_sync(self.spawn.stop)

    def _close_trace(self) -> None:
        self.hub.close()
        if self.process is not None:
            self.process.end()
        self._provider.shutdown()
