"""Tracing setup: one TracerProvider per run, and the exporters the CLI offers.

Span names and attributes are a contract (DESIGN.md section 2); the names live here so the
pipeline, the tests and the docs use one spelling.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.config import ConfigError

ROOT_SPAN = "bootstrap.pipeline"
TRACER_NAME = "bootstrap"


def stage_span(stage_id: str) -> str:
    return f"bootstrap.stage.{stage_id}"


def attempt_span(stage_id: str) -> str:
    return f"bootstrap.stage.{stage_id}.attempt"


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
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (the ``--trace-file`` contract)."""

    def __init__(self, path: Path) -> None:
        """Creates missing parent directories; an existing file is overwritten (one run, one trace)."""
        self._path = Path(path)
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = self._path.open("w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"trace_file: cannot write {self._path}: {exc.strerror or exc}") from None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                self._file.write(json.dumps(span_record(span), default=str) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


class MissingExtra(RuntimeError):
    """An optional feature was asked for without the extra that provides it."""


def otlp_exporter() -> SpanExporter:
    """OTLP over HTTP; needs the ``otlp`` extra. Endpoint settings follow the OTel SDK's own."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise MissingExtra(
            "OTLP export needs the otlp extra: pip install 'executor-bootstrap[otlp]'"
        ) from exc
    return OTLPSpanExporter()


def make_tracer_provider(
    *, trace_file: Path | None = None, otlp: bool = False, memory: InMemorySpanExporter | None = None
) -> TracerProvider:
    """A provider exporting finished spans synchronously, so nothing is lost on exit."""
    provider = TracerProvider(resource=Resource.create({"service.name": "executor-bootstrap"}))
    exporters: list[SpanExporter] = []
    if trace_file is not None:
        exporters.append(JsonLinesSpanExporter(trace_file))
    if otlp:
        exporters.append(otlp_exporter())
    if memory is not None:
        exporters.append(memory)
    for exporter in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider
