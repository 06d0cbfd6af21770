"""The engine's own process (``bootstrap serve``'s default): its ``Bootstrap``, the stages, the
executor, torch and the device live here; the server's process holds HTTP, tokens and SSE.

The server runs ``python -m bootstrap.api.engine_process CALLS NOTES ...``, binds
both sockets and sends ``Start`` (``control``). This process makes the backend, says ``Hello``
(or ``Fatal``), then runs each ``Call`` as a task, replying with the state after it and, while an
executor is started, the ``Served`` channel its ``EngineCore`` connects to. A live operation's
drain is asked of the server (``DrainAsk``), which holds the requests. It ignores SIGINT and
SIGTERM (the server drains, then calls ``aclose``) and dies with the server (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import zmq
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from bootstrap.api import control as c
from bootstrap.api.operation_terms import Busy, Refused, Reverted
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.engine.executor.channel.threads import Receiver
from bootstrap.engine.executor.event_loops import call_soon_threadsafe
from bootstrap.pipeline import StageFailed
from bootstrap.pipeline.process import spawn_time_ns
from bootstrap.pipeline.runner import cause_chain
from bootstrap.pipeline.telemetry import span_record

log = logging.getLogger("bootstrap.engine")
METHODS = ("build", "retry", "swap", "update_weights", "sleep", "wake", "aclose")
DRAINED = ("swap", "update_weights", "sleep")  # the operations that take the server's drain
KINDS = (StageFailed, Reverted, Refused, Busy, ConfigError)  # rebuilt as themselves by the server
PR_SET_PDEATHSIG = 1


def failure_of(exc: BaseException) -> c.Failure:
    """``exc`` as the server rebuilds it (``control.Failure``)."""
    kind = next((k.__name__ for k in KINDS if isinstance(exc, k)), "other")
    causes = [(type(inner).__module__, type(inner).__name__, str(inner)) for inner in cause_chain(exc)]
    if isinstance(exc, StageFailed):
        return c.Failure(kind, type(exc).__name__, str(exc), exc.stage, exc.attempts, exc.advice, causes)
    return c.Failure(kind, type(exc).__name__, str(exc), causes=causes)


class SpanForwarder(SpanExporter):
    """Each finished span, as a trace-file record, to the server (``control.Spans``)."""

    def __init__(self, engine: EngineProcess) -> None:
        self._engine = engine

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._engine.send(c.Spans([span_record(span) for span in spans]))
        return SpanExportResult.SUCCESS


class ServerParent:
    """The server's process span as the parent of this process's pipelines (one trace): what
    ``Bootstrap`` asks of a ``ProcessTimeline``, the phases being the server's own."""

    def __init__(self, ids: tuple[str, str]) -> None:
        trace_id, span_id = (int(part, 16) for part in ids)
        context = trace.SpanContext(
            trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)
        )
        self._span = trace.NonRecordingSpan(context)

    def attach(self, tracer: object) -> None:
        return None

    def phase(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        with trace.use_span(self._span, end_on_exit=False):
            yield

    def end(self) -> None:
        return None


class EngineProcess:
    """This process's end of the control plane (``calls`` read, ``notes`` written)."""

    def __init__(self, calls: str, notes: str) -> None:
        self._context = zmq.Context()
        self._lock = threading.Lock()  # the notes socket: the loop and the threads that end spans
        self._notes = self._context.socket(zmq.PUSH)
        self._notes.setsockopt(zmq.SNDHWM, 0)
        self._notes.setsockopt(zmq.LINGER, 5000)  # what is sent before the exit still reaches the server
        self._notes.connect(notes)
        calls_socket = self._context.socket(zmq.PULL)
        calls_socket.connect(calls)
        self._calls = Receiver(self._context, calls_socket, self._received, "bootstrap-engine-calls")
        self._send_frame, self._frames = anyio.create_memory_object_stream[bytes](max_buffer_size=float("inf"))
        self.boot: Any = None
        self._bind_dir = ""
        self._scopes: dict[int, anyio.CancelScope] = {}
        self._drains: dict[int, anyio.Event] = {}
        self._cores: dict[int, Any] = {}  # core id -> EngineCore
        self._served: tuple[object, c.Served] | None = None  # the executor the newest core serves
        self._core_ids = itertools.count(1)
        self._call_soon: Any = None
        self.moments: dict[str, tuple[int, int]] = {}  # this process's own phases (``_trace_moments``)

    def send(self, message: object) -> None:
        frame = c.encode(message)
        with self._lock:
            if not self._notes.closed:
                self._notes.send(frame)

    def _received(self, frame: bytes) -> None:  # the calls thread
        with contextlib.suppress(RuntimeError):  # the loop ended: nobody reads it
            self._call_soon(self._put, frame)

    def _put(self, frame: bytes) -> None:
        with contextlib.suppress(anyio.ClosedResourceError):  # closed: the aclose call was answered
            self._send_frame.send_nowait(frame)

    async def run(self) -> int:
        self._call_soon = call_soon_threadsafe()
        self._calls.start()
        try:
            start = c.decode_to_engine(await self._frames.receive())
            if not isinstance(start, c.Start) or not self._begin(start):
                return 1
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._forward_events)
                async for frame in self._frames:
                    self._apply(c.decode_to_engine(frame), tasks)
                tasks.cancel_scope.cancel()
            return 0
        finally:
            for core in self._cores.values():
                core.close()
            self._calls.stop()
            with self._lock:
                self._notes.close()
            self._context.term()

    def _begin(self, start: c.Start) -> bool:
        """The backend and the ``Bootstrap`` (``Hello``), or ``Fatal``; what the server's
        ``make_bootstrap`` does in its own process."""
        sys.path.extend(p for p in start.sys_path if p not in sys.path)
        self._bind_dir = start.bind_dir
        received = time.time_ns()
        try:
            config = BootstrapConfig.model_validate(start.config)
            from bootstrap.api import Bootstrap
            from bootstrap.api.factory import load_backend_factory

            if start.backend_factory is None:
                from bootstrap.engine.kernels import triton_start

                triton_start.begin_for(config.device, config.backend, config.tensor_parallel_size)
            backend = load_backend_factory(start.backend_factory)(config)
            self.moments["engine.backend"] = (received, time.time_ns())
            forward = SpanForwarder(self) if start.forward_spans else None
            parent = ServerParent(start.parent) if start.parent is not None else None
            self.boot = Bootstrap(config, backend=backend, otlp=start.otlp, process=parent, forward_spans=forward)
            self._trace_moments(parent)
        except Exception as exc:
            failure = failure_of(exc)
            log.log(logging.ERROR if failure.kind == "other" else logging.DEBUG, "no backend", exc_info=True)
            self.send(c.Fatal(failure))
            return False
        log.info("engine process %d: backend ready (%s on %s)", os.getpid(), type(backend).__name__, config.device)
        self.send(c.Hello(os.getpid(), self.snapshot(report=True)))
        return True

    def _trace_moments(self, parent: ServerParent | None) -> None:
        """This process's start as spans of the trace, under the server's process span:
        ``engine.imports`` (its interpreter's start to its imports' end: torch's) and
        ``engine.backend`` (``Start`` received to the backend made: the device's set-up)."""
        tracer = self.boot.tracer
        with parent.current() if parent is not None else contextlib.nullcontext():
            for name, (began, ended) in self.moments.items():
                tracer.start_span(f"bootstrap.{name}", start_time=began).end(end_time=ended)

    def snapshot(self, report: bool = False) -> c.Snapshot:
        boot = self.boot
        return c.Snapshot(
            busy=boot.busy,
            asleep=boot.asleep,
            live=boot.executor is not None,
            status=boot.stage_status(),
            plan=boot.plan(),
            operations=list(boot.operations),
            report=boot.report().to_dict() if report else None,
        )

    async def _forward_events(self) -> None:
        async for event in self.boot.events():
            self.send(c.Events([event], self.snapshot()))

    def _apply(self, message: c.ToEngine, tasks: anyio.abc.TaskGroup) -> None:
        if isinstance(message, c.Call):
            tasks.start_soon(self._call, message)
        elif isinstance(message, c.Abandon):
            scope = self._scopes.get(message.call_id)
            if scope is not None:
                scope.cancel()
        elif isinstance(message, c.Drained):
            drained = self._drains.pop(message.call_id, None)
            if drained is not None:
                drained.set()
        elif isinstance(message, c.Unserve):
            core = self._cores.pop(message.core, None)
            if core is not None:
                core.close()

    async def _call(self, call: c.Call) -> None:
        failure: c.Failure | None = None
        with anyio.CancelScope() as scope:
            self._scopes[call.call_id] = scope
            try:
                failure = await self._run(call)
            except Exception as exc:
                failure = failure_of(exc)
                unforeseen = failure.kind == "other"  # a bug's traceback is here only: the server rebuilds the rest
                log.log(logging.ERROR if unforeseen else logging.DEBUG, "%s failed", call.method, exc_info=True)
        self._scopes.pop(call.call_id, None)
        ended_ns = time.time_ns()
        if scope.cancelled_caught:
            failure = c.Failure("Cancelled", "Cancelled", f"the {call.method} was cancelled")
        if call.method == "aclose":
            for core in self._cores.values():
                core.close()
            self._cores.clear()
        served = None
        if call.method != "aclose":
            try:
                served = self._serving()
            except Exception as exc:  # no channel to the executor: the call fails, named (the server would wait)
                log.error("%s: the executor's channel failed", call.method, exc_info=True)
                failure = failure or failure_of(exc)
        self.send(c.Reply(call.call_id, self.snapshot(report=True), failure, served, ended_ns))
        if call.method == "aclose":  # the last reply: the loop over the server's messages ends
            self._send_frame.close()

    async def _run(self, call: c.Call) -> c.Failure | None:
        if call.method not in METHODS:
            return c.Failure("other", "ValueError", f"no such call: {call.method!r}")
        args = dict(call.args)
        if call.method == "swap":
            args["config"] = BootstrapConfig.model_validate(args["config"])
        if call.method in DRAINED:
            args["drain"] = lambda: self._drain(call.call_id)
        await getattr(self.boot, call.method)(**args)
        return None

    async def _drain(self, call_id: int) -> None:
        """The server drains the requests (it holds them) and closes its end of the channel."""
        drained = self._drains[call_id] = anyio.Event()
        try:
            self.send(c.DrainAsk(call_id))
            await drained.wait()
        finally:
            self._drains.pop(call_id, None)

    def _serving(self) -> c.Served | None:
        """The channel of the executor started now, a core made for it once (connected to the
        addresses the server will bind: ZeroMQ queues what is sent until it does)."""
        executor = self.boot.executor
        for core_id, core in list(self._cores.items()):  # a core whose executor is gone answers nobody
            if core.executor is not executor:
                core.close()
                del self._cores[core_id]
        if executor is None:
            return None
        if self._served is not None and self._served[0] is executor and self._served[1].core in self._cores:
            return self._served[1]
        from bootstrap.engine.executor.channel.engine_side import EngineCore

        core_id = next(self._core_ids)
        addresses = (f"ipc://{self._bind_dir}/cmd{core_id}", f"ipc://{self._bind_dir}/out{core_id}")  # short: 107 bytes
        tokenizer = pickle.dumps(executor.tokenizer) if executor.tokenizer is not None else None
        served = c.Served(core_id, addresses, executor.runner.vocab_size, executor.engine_stats(), tokenizer)
        core = EngineCore(executor, self._context, *addresses)
        core.start()
        self._cores[core_id] = core
        self._served = (executor, served)
        return served


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when the server's process ends, however it ends (and
    exits now if it already has)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str]) -> int:
    """``CALLS NOTES PARENT_PID LOG_LEVEL TRITON`` (``triton``: begin Triton's start first, or ``-``)."""
    calls, notes, parent, level, triton = argv
    _die_with_parent(int(parent))
    if triton == "triton":  # its thread compiles while this process imports torch, as in a server's process
        from bootstrap.engine.kernels import triton_start

        triton_start.begin()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's terminal sends it to both: the server decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=level.upper(), format="%(levelname)s:     %(message)s", stream=sys.stderr)
    engine = EngineProcess(calls, notes)  # connected: what the server sends meanwhile waits in the socket
    with contextlib.suppress(ImportError):  # now, while the server imports its own (one missing: said at Start)
        import bootstrap.api
        import bootstrap.backends.native.backend  # noqa: F401  (torch)
    engine.moments["engine.imports"] = (spawn_time_ns(), time.time_ns())
    return anyio.run(engine.run)


if __name__ == "__main__":
    status = main(sys.argv[1:])
    logging.shutdown()  # everything was released by aclose: the interpreter's own teardown (torch's) is skipped
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
