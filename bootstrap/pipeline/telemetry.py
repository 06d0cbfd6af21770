"""Tracing setup: one TracerProvider per run, and the exporters the CLI offers.

Span names and attributes are a contract (``docs/design.md``, the stage contract); the names live here so the
pipeline, the tests and the docs use one spelling.

A trace destination never decides a run's outcome: each exporter is wrapped so that its first
failure (a full disk, an unreachable collector) is one warning, and it gets no more spans in
that run. The trace file is written as each span ends; OTLP is exported in batches from a
background thread with a short timeout, so a slow or absent collector never slows a stage.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.config import ConfigError
from bootstrap.paths import ensure_directory

ROOT_SPAN = "bootstrap.pipeline"
OPERATIONS = ("swap", "weights", "sleep", "wake")  # a live server's operations, each a root span of its own
TRACER_NAME = "bootstrap"
REQUEST_SPAN = "bootstrap.request"  # one per traced HTTP generation request (``bootstrap.serve.request_trace``)
CHOICE_SPAN = "bootstrap.request.choice"  # one per choice, parent of its queue, prefill and decode spans
REQUEST_QUEUE = 16384  # request spans waiting for the file's exporting thread (5 a request; the SDK's 2048 overflowed)
OTLP_TIMEOUT_S = 2.0  # per export, retries included; the collector is local or near in practice

log = logging.getLogger(__name__)


def operation_span(operation: str) -> str:
    """``bootstrap.swap``, ``.weights``, ``.sleep``, ``.wake``: the root of one live operation."""
    return f"bootstrap.{operation}"


def is_root_span(name: str) -> bool:
    """A start's ``bootstrap.pipeline`` or an operation's root."""
    return name == ROOT_SPAN or name in {operation_span(o) for o in OPERATIONS}


def stage_span(stage_id: str) -> str:
    return f"bootstrap.stage.{stage_id}"


def attempt_span(stage_id: str) -> str:
    return f"bootstrap.stage.{stage_id}.attempt"


def request_phase_span(phase: str) -> str:
    """``queue``, ``prefill`` or ``decode`` of one choice."""
    return f"{REQUEST_SPAN}.{phase}"


def is_request_span(name: str) -> bool:
    return name == REQUEST_SPAN or name.startswith(REQUEST_SPAN + ".")


class SpansWhere(SpanProcessor):
    """Forwards to ``processor`` only the spans whose name ``keep`` accepts: request spans stay
    out of the in-memory copy a ``Bootstrap`` keeps for its report (however long the server
    runs), and go to the trace file in batches while the bootstrap's go as each ends."""

    def __init__(self, processor: SpanProcessor, keep: Callable[[str], bool]) -> None:
        self._processor, self._keep = processor, keep

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if self._keep(span.name):
            self._processor.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if self._keep(span.name):
            self._processor.on_end(span)

    def shutdown(self) -> None:
        self._processor.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._processor.force_flush(timeout_millis)


def not_request_span(name: str) -> bool:
    return not is_request_span(name)


def span_record(span: ReadableSpan) -> dict:
    """One finished span as a trace-file line (contract keys, ids in lowercase hex)."""
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (the ``--trace-file`` contract)."""

    def __init__(self, path: Path) -> None:
        """Creates missing parent directories; an existing file is overwritten (one run, one trace)."""
        self._path = Path(path)
        ensure_directory(self._path.parent, "trace_file")
        try:
            self._file: IO[str] = self._path.open("w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"trace_file: cannot write to {self._path}: {exc.strerror or exc}") from None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.write([span_record(span) for span in spans])

    def write(self, records: Sequence[dict]) -> SpanExportResult:
        """``span_record``s, another process's included; nothing once the file is closed."""
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            for record in records:
                self._file.write(json.dumps(record, default=str) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def __str__(self) -> str:
        return f"trace file {self._path}"


class WarnOnce(SpanExporter):
    """Wraps an exporter so its failures never reach the run: the first failed export, flush or
    shutdown (an exception or a FAILURE result) logs one warning naming the destination; from
    then on the destination gets no more spans, and the wrapped exporter is still shut down."""

    def __init__(self, exporter: SpanExporter, destination: str, why: str = "") -> None:
        """``why`` explains a failure the exporter reports without an exception."""
        self._exporter, self.destination, self._why = exporter, destination, why
        self.failed = False
        self._lock = threading.Lock()  # spans end on several threads: one warning, not one each

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.failed:
            return SpanExportResult.FAILURE
        try:
            result = self._exporter.export(spans)
        except Exception as exc:  # whatever the exporter raises, the run goes on
            return self._fail(exc)
        return result if result is SpanExportResult.SUCCESS else self._fail(None)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self._exporter.force_flush(timeout_millis)
        except Exception as exc:
            self._fail(exc)
            return False

    def shutdown(self) -> None:
        try:
            self._exporter.shutdown()
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException | None) -> SpanExportResult:
        with self._lock:
            first, self.failed = not self.failed, True
        if first:
            reason = self._why if exc is None else getattr(exc, "strerror", None) or str(exc)
            log.warning(
                "could not export spans to %s%s; the rest of this run's spans are not sent there",
                self.destination,
                f" ({reason})" if reason else "",
            )
        return SpanExportResult.FAILURE


class MissingExtra(RuntimeError):
    """An optional feature was asked for without the extra that provides it."""


class _Drop(logging.Filter):
    """Drops the OTLP exporter's own log lines (a traceback-free retry log per batch): its
    ``WarnOnce`` wrapper reports the outcome in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


_DROP = _Drop()


def otlp_exporter() -> WarnOnce:
    """OTLP over HTTP with a short timeout; needs the ``otlp`` extra. The endpoint and headers
    follow the OTel SDK's settings (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, default
    ``http://localhost:4318/v1/traces``); the timeout is ``OTLP_TIMEOUT_S``."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise MissingExtra("OTLP export needs the otlp extra: pip install 'executor-bootstrap[otlp]'") from exc
    logging.getLogger(OTLPSpanExporter.__module__).addFilter(_DROP)  # idempotent: the same filter object
    exporter = OTLPSpanExporter(timeout=OTLP_TIMEOUT_S)
    why = f"no collector answered within {OTLP_TIMEOUT_S:g} s, or it refused the spans"
    return WarnOnce(exporter, f"OTLP endpoint {exporter._endpoint}", why)


def make_tracer_provider(
    *,
    trace_file: Path | None = None,
    otlp: bool = False,
    memory: InMemorySpanExporter | None = None,
    requests: bool = False,
    file: JsonLinesSpanExporter | None = None,
    forward: SpanExporter | None = None,
) -> TracerProvider:
    """A provider with the asked-for destinations. The trace file and the in-memory exporter (which
    skips request spans) get each span as it ends; OTLP gets batches from a background thread
    (flushed by ``shutdown()``). With ``requests`` (a server that traces its requests), request
    spans reach the trace file in batches from a background thread too, so a request never
    waits on the disk; that thread is flushed and joined by ``shutdown()``, before the file closes.
    ``file``: the trace file's exporter, made by the caller (which writes another process's spans
    into it too); ``forward``: gets each span but the requests' as it ends (the engine's process
    sends them to the server's file)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "executor-bootstrap"}))
    if trace_file is not None or file is not None:
        exporter = file or JsonLinesSpanExporter(trace_file)
        to_file = WarnOnce(exporter, str(exporter))
        if requests:  # added first: shut down (flushed into the still open file) first
            batches = BatchSpanProcessor(to_file, max_queue_size=REQUEST_QUEUE, schedule_delay_millis=1000)
            provider.add_span_processor(SpansWhere(batches, is_request_span))
        provider.add_span_processor(
            SpansWhere(SimpleSpanProcessor(to_file), not_request_span) if requests else SimpleSpanProcessor(to_file)
        )
    if otlp:
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter()))
    if memory is not None:
        provider.add_span_processor(SpansWhere(SimpleSpanProcessor(memory), not_request_span))
    if forward is not None:
        provider.add_span_processor(SpansWhere(SimpleSpanProcessor(forward), not_request_span))
    return provider
