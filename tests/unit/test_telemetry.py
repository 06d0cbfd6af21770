"""Trace destinations: a failing one is one warning and never the run's outcome; OTLP is
exported in batches off the run's path, to a real (local) collector, or not at all."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import sys
import threading
from pathlib import Path

import pytest

from bootstrap.cli.main import main
from bootstrap.pipeline import Pipeline
from bootstrap.pipeline.stage import Stage
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages import STAGE_IDS

OTLP_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"]


def warnings_logged(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace collector on a free local port; keeps every request it answers."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CollectorHandler)
        self.requests: list[dict] = []
        self.run_done = False  # set by the test when the run under test has returned
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def span_names(self) -> list[str]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        names = []
        for request in self.requests:
            message = ExportTraceServiceRequest()
            message.ParseFromString(request["body"])
            names += [s.name for rs in message.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return names


class _CollectorHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append(
            {"path": self.path, "type": self.headers["Content-Type"], "body": body, "run_done": self.server.run_done}
        )
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector(monkeypatch):
    pytest.importorskip(OTLP_MODULE)
    server = Collector()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", server.url)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def no_collector(monkeypatch):
    """An endpoint on a local port nobody listens on (connection refused at once)."""
    pytest.importorskip(OTLP_MODULE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url)
    return url


def test_otlp_sends_every_span_to_the_collector(collector, capsys, caplog):
    assert main([*PLAN, "--otlp"]) == 0
    assert {r["path"] for r in collector.requests} == {"/v1/traces"}
    assert {r["type"] for r in collector.requests} == {"application/x-protobuf"}
    names = collector.span_names()
    assert names.count("bootstrap.pipeline") == 1
    assert {f"bootstrap.stage.{s}" for s in STAGE_IDS} <= set(names)
    assert warnings_logged(caplog) == []


async def test_otlp_export_is_off_the_runs_path(collector):
    """Spans are batched and sent from a background thread: nothing reaches the collector
    while the run is in progress (a synchronous exporter would post as each span ends)."""
    provider = make_tracer_provider(otlp=True)
    stages = [Stage("one", lambda seed: seed + 1, "a"), Stage("two", lambda a: a * 2, "b")]
    pipeline = Pipeline(stages, {"seed": 1}, tracer_provider=provider)
    assert (await pipeline.run())["b"] == 4
    collector.run_done = True
    await pipeline.aclose()
    provider.shutdown()  # flushes the batch
    assert collector.requests and all(r["run_done"] for r in collector.requests)
    assert sorted(collector.span_names()) == sorted(
        [
            "bootstrap.pipeline",
            "bootstrap.stage.one",
            "bootstrap.stage.one.attempt",
            "bootstrap.stage.two",
            "bootstrap.stage.two.attempt",
        ]
    )


def test_otlp_without_a_collector_is_one_warning_and_a_successful_run(no_collector, capsys, caplog):
    assert main([*PLAN, "--otlp", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] is None and "Traceback" not in err
    (warning,) = warnings_logged(caplog)  # not one per batch, retry or span
    assert warning.name == "bootstrap.pipeline.telemetry"
    assert f"OTLP endpoint {no_collector}" in warning.getMessage()
    assert "no collector answered" in warning.getMessage()


def test_otlp_without_its_extra_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, OTLP_MODULE, None)  # as if the extra were not installed
    assert main([*PLAN, "--otlp"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'executor-bootstrap[otlp]'" in err and "Traceback" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file whose writes fail")
@pytest.mark.parametrize("fault, code", [([], 0), (["--fault", "final_build:oom:99"], 1)])
def test_a_full_disk_under_the_trace_file_is_one_warning_not_the_outcome(capsys, caplog, fault, code):
    assert main([*PLAN, "--trace-file", "/dev/full", *fault]) == code
    (warning,) = warnings_logged(caplog)  # not one per span, nor an error from shutdown
    assert warning.getMessage().startswith("could not export spans to trace file /dev/full (No space left on device)")
    assert "Traceback" not in capsys.readouterr().err
