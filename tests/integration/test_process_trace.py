"""The whole process in the trace (``bootstrap.pipeline.process``): a fresh ``bootstrap run`` and
``bootstrap serve`` write a ``bootstrap.process`` span from the spawn, with phases that cover
spawn → ready and ready → exit; the first line comes before the engine's imports; Ctrl-C is
acknowledged at once, naming what rolls back, before the rollback ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.serve_process import ROOT, ServeProcess
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.timeline import coverage
from bootstrap.pipeline.process import PROCESS_SPAN, ProcessTimeline, spawn_time_ns
from bootstrap.pipeline.telemetry import ROOT_SPAN

ENGINE = "bootstrap.engine."  # the spans of the engine's own process


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("process") / "llama", chat_template=CHAT_TEMPLATE)


def phases(spans: list[dict]) -> list[str]:
    process = next(s for s in spans if s["name"] == PROCESS_SPAN)
    children = sorted(
        (s for s in spans if s["parent_span_id"] == process["span_id"] and not s["name"].startswith(ENGINE)),
        key=lambda s: s["start_time_unix_nano"],
    )
    return [s["name"].removeprefix("bootstrap.process.").removeprefix("bootstrap.") for s in children]


def test_a_fresh_run_is_traced_from_its_spawn_to_its_exit(llama, tmp_path):
    trace = tmp_path / "trace.jsonl"
    before = time.time_ns()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "run",
            "--device",
            "cpu",
            "--model",
            str(llama),
            "--chat",
            "w7 w8",
            "--max-tokens",
            "4",
            "--no-plan-cache",
            "--trace-file",
            str(trace),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    after = time.time_ns()
    assert done.returncode == 0, done.stderr
    spans = read_spans(trace)
    process = next(s for s in spans if s["name"] == PROCESS_SPAN)
    assert (
        before - 20_000_000 <= process["start_time_unix_nano"] <= process["end_time_unix_nano"] <= after
    )  # 10 ms ticks
    assert phases(spans) == ["start", "checks", "backend", "pipeline", "answer", "shutdown"]
    root = next(s for s in spans if s["name"] == ROOT_SPAN)
    assert root["parent_span_id"] == process["span_id"]
    share = coverage(spans, process)
    assert share["to_ready"] >= 0.95 and share["after_ready"] >= 0.95, share
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"bootstrap run: {llama} on cpu") and str(trace) in first  # before any stage's line


def test_a_server_is_traced_through_serving_draining_and_shutdown(llama, tmp_path):
    trace = tmp_path / "serve.jsonl"
    server = ServeProcess(tmp_path / "serve.log", "--model", str(llama), "--trace-file", str(trace), "--no-plan-cache")
    try:
        server.wait_state("ready")
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()
    spans = read_spans(trace)
    assert phases(spans) == ["start", "checks", "server", "backend", "pipeline", "serving", "draining", "shutdown"]
    process = next(s for s in spans if s["name"] == PROCESS_SPAN)
    backend = next(s for s in spans if s["name"] == "bootstrap.process.backend")
    engine = {s["name"].removeprefix(ENGINE): s for s in spans if s["name"].startswith(ENGINE)}
    assert sorted(engine) == ["backend", "imports"]  # the engine's process's own start, in the same trace
    assert all(s["parent_span_id"] == process["span_id"] for s in engine.values())
    imports, made = engine["imports"], engine["backend"]
    assert process["start_time_unix_nano"] <= imports["start_time_unix_nano"] < imports["end_time_unix_nano"]
    assert imports["end_time_unix_nano"] <= made["start_time_unix_nano"] < made["end_time_unix_nano"]
    assert backend["start_time_unix_nano"] <= made["start_time_unix_nano"]
    assert made["end_time_unix_nano"] <= backend["end_time_unix_nano"]
    share = coverage(spans, process)
    assert share["to_ready"] >= 0.95 and share["after_ready"] >= 0.95, share
    assert server.log().splitlines()[0].startswith(f"bootstrap serve: {llama} on cpu, http://127.0.0.1:0")


def test_ctrl_c_is_acknowledged_at_once_naming_the_stage_that_rolls_back(tmp_path):
    """SIGINT while ``profiling`` runs: the acknowledgement (naming it) comes first, then the
    rollback, then the closing line; exit status 130."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "run",
            "--device",
            "cpu",
            "--model",
            "random:smollm2-135m",
            "--max-num-tokens",  # a 2,048-token profiling forward: seconds on a CPU, the signal lands inside it
            "2048",
            "--max-seq-len",
            "2048",
            "--no-plan-cache",
            "--trace-file",
            str(tmp_path / "t.jsonl"),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip())
        if "profiling" in line and "started" in line:
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stderr.read().splitlines()
    assert proc.wait(timeout=120) == 130, lines
    heard = next(i for i, line in enumerate(lines) if line.startswith("bootstrap: interrupted: rolling back"))
    assert "profiling" in lines[heard]
    assert lines[-1] == "bootstrap: interrupted; completed stages were rolled back" and heard < len(lines) - 1
    process = next(s for s in read_spans(tmp_path / "t.jsonl") if s["name"] == PROCESS_SPAN)
    assert process["end_time_unix_nano"] > process["start_time_unix_nano"]  # the process span still ends


def test_phases_before_the_tracer_keep_their_times_and_errors_mark_their_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    timeline = ProcessTimeline(spawn_ns=time.time_ns() - 2_000_000_000)
    with timeline.phase("checks"):
        pass
    checks = timeline.phases[-1]
    timeline.attach(provider.get_tracer("test"))
    with pytest.raises(ValueError), timeline.phase("backend"):
        raise ValueError("no such device")
    timeline.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["bootstrap.process"].start_time == timeline.spawn_ns
    assert (spans["bootstrap.process.checks"].start_time, spans["bootstrap.process.checks"].end_time) == (
        checks.start_ns,
        checks.end_ns,
    )
    assert spans["bootstrap.process.start"].end_time - spans["bootstrap.process.start"].start_time >= 2_000_000_000
    assert spans["bootstrap.process.backend"].status.description == "ValueError: no such device"
    assert all(
        s.parent.span_id == spans["bootstrap.process"].context.span_id
        for n, s in spans.items()
        if n != "bootstrap.process"
    )


def test_the_spawn_time_is_this_process_s_start():
    """A child started now reports a spawn within its parent's window (10 ms clock ticks)."""
    before = time.time_ns()
    out = subprocess.run(
        [sys.executable, "-c", "from bootstrap.pipeline.process import spawn_time_ns; print(spawn_time_ns())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert before - 20_000_000 <= int(out) <= time.time_ns()
    assert spawn_time_ns() <= time.time_ns()


def test_an_exec_does_not_carry_the_shell_s_wait_into_the_start():
    """``bash -c "...; exec bootstrap ..."`` (what ``bash -c`` does with its last command) keeps the
    shell's process and its start in ``/proc``: the start is the interpreter's, after the exec."""
    script = "read go; exec {} -c 'from bootstrap.pipeline.process import spawn_time_ns; print(spawn_time_ns())'"
    shell = subprocess.Popen(
        ["bash", "-c", script.format(sys.executable)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    time.sleep(0.5)  # the shell waits (spends no CPU) as pip would run before it
    released = time.time_ns()
    out, _ = shell.communicate(b"go\n", timeout=60)
    assert shell.returncode == 0
    assert released - 50_000_000 <= int(out) <= time.time_ns()  # 50 ms: the shell's own CPU, before the exec


def test_trace_shows_the_process_and_its_coverage(llama, tmp_path):
    trace = tmp_path / "trace.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "run",
            "--device",
            "cpu",
            "--model",
            str(llama),
            "--prompt",
            "w5",
            "--max-tokens",
            "2",
            "--trace-file",
            str(trace),
            "--json",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    shown = subprocess.run(
        [sys.executable, "-m", "bootstrap.cli", "trace", str(trace)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"COLUMNS": "200", "PATH": ""},
    ).stdout
    assert "process" in shown and "spans cover" in shown and "backend" in shown and "answer" in shown
    assert json.loads(trace.read_text().splitlines()[0])["name"].startswith("bootstrap.")


def test_coverage_counts_the_union_of_the_phases_against_spawn_to_ready_and_ready_to_end():
    """Spawn at 0, ready at 10, end at 20 (ns): phases 0-3, 2-4 (overlapping), the run 5-10, then
    10-12 and 15-20. Covered: 9 of 10 before ready (4-5 is a gap), 7 of 10 after (12-15 is)."""

    def span(name, start, end, span_id, parent="p"):
        return {
            "name": name,
            "span_id": span_id,
            "parent_span_id": parent,
            "start_time_unix_nano": start,
            "end_time_unix_nano": end,
            "status": "UNSET",
            "attributes": {},
        }

    process = span(PROCESS_SPAN, 0, 20, "p", None)
    spans = [
        process,
        span("bootstrap.process.start", 0, 3, "a"),
        span("bootstrap.process.checks", 2, 4, "b"),
        span(ROOT_SPAN, 5, 10, "r"),
        span("bootstrap.process.answer", 10, 12, "c"),
        span("bootstrap.process.shutdown", 15, 20, "d"),
    ]
    assert coverage(spans, process) == {"to_ready": 0.9, "after_ready": 0.7}
    assert coverage([process, spans[1]], process) is None  # no finished run: no ready to measure against
