"""The process a pipeline runs in, as spans, so a trace accounts for a whole start and not only
its stages.

``bootstrap.process`` runs from the interpreter's start (``spawn_time_ns``) to the end of the
shutdown. Under it, a span per phase the command marks:
``bootstrap.process.start`` (the interpreter and the command's imports, up to its ``main``),
``.checks`` (arguments and inputs), ``.backend`` (the engine's imports and its device), the
pipeline's own root span, then ``.answer`` or ``.serving``, and ``.shutdown``. Phases that end
before there is a tracer are kept and written with their real times once ``attach`` gives one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

PROCESS_SPAN = "bootstrap.process"
PHASE_PREFIX = "bootstrap.process."


_IMPORTED = (time.time_ns(), time.process_time_ns())  # the fallback first moment: this module's import


def spawn_time_ns(first_moment: tuple[int, int] | None = None) -> int:
    """When this process's interpreter started, in Unix nanoseconds, as it measures it: at
    ``first_moment`` (Unix ns, the process's CPU ns then; the command's first line, default this
    module's import) less the CPU spent by then (the interpreter's own start), never before the
    process's start in Linux's ``/proc``. Not that start alone: an ``exec`` keeps the start of the
    process it replaces, so ``bash -c "pip install ...; bootstrap run"`` would count pip's minutes
    (the shell's own CPU, milliseconds, is all an exec carries over; waiting is not CPU)."""
    wall_ns, cpu_ns = first_moment or _IMPORTED
    interpreter_ns = wall_ns - cpu_ns
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22: start time, in ticks after boot
        age_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return interpreter_ns
    return max(interpreter_ns, time.time_ns() - max(age_ns, 0))


@dataclass
class Phase:
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ProcessTimeline:
    """The phases of one process, and (once attached to a tracer) their spans."""

    def __init__(self, spawn_ns: int | None = None) -> None:
        """``spawn_ns`` None: the process's start; the time from it to now is the start phase."""
        now = time.time_ns()
        self.spawn_ns = min(spawn_ns if spawn_ns is not None else spawn_time_ns(), now)
        self.phases: list[Phase] = [Phase(f"{PHASE_PREFIX}start", self.spawn_ns, now)]
        self._tracer: Tracer | None = None
        self._span: Span | None = None

    @classmethod
    def from_now(cls) -> ProcessTimeline:
        """A timeline that starts now (a command called inside a longer-lived process)."""
        return cls(time.time_ns())

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[None]:
        """Record ``bootstrap.process.<name>`` around the block (a span at once when attached)."""
        phase = self.begin(name, **attributes)
        try:
            yield
        except BaseException as exc:
            phase.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.finish(phase)

    def begin(self, name: str, start_ns: int | None = None, **attributes: Any) -> Phase:
        """A phase that starts now (or at ``start_ns``, a moment already past) and ends at
        ``finish`` (one that spans several calls)."""
        return Phase(f"{PHASE_PREFIX}{name}", start_ns or time.time_ns(), 0, attributes)

    def finish(self, phase: Phase) -> None:
        phase.end_ns = time.time_ns()
        self.phases.append(phase)
        if self._span is not None:
            self._write(phase)

    def attach(self, tracer: Tracer) -> None:
        """Open the process span (from the spawn) on ``tracer`` and write the phases so far."""
        if self._span is not None:
            return
        self._tracer = tracer
        self._span = tracer.start_span(
            PROCESS_SPAN, start_time=self.spawn_ns, attributes={"bootstrap.pid": os.getpid()}
        )
        for phase in self.phases:
            self._write(phase)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The process span as the current span (the pipeline's root becomes its child)."""
        if self._span is None:
            yield
            return
        with trace.use_span(self._span, end_on_exit=False):
            yield

    def span_ids(self) -> tuple[int, int] | None:
        """The process span's trace id and span id once attached (another process's spans join it)."""
        if self._span is None:
            return None
        context = self._span.get_span_context()
        return context.trace_id, context.span_id

    def end(self) -> None:
        """End the process span (idempotent)."""
        if self._span is not None and self._span.is_recording():
            self._span.end()

    def _write(self, phase: Phase) -> None:
        parent = trace.set_span_in_context(self._span)
        span = self._tracer.start_span(
            phase.name, context=parent, start_time=phase.start_ns, attributes=phase.attributes
        )
        if phase.error is not None:
            span.set_status(Status(StatusCode.ERROR, phase.error))
        span.end(end_time=phase.end_ns)
