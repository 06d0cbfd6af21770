"""No user or library text is read as rich markup (issue 20, item 5): a path such as
``odd[/llama]``, a gloo error's ``[/pytorch/...]``, torch's ``[enforce fail at ...]`` and span
text such as ``[red]x[/red]`` reach the terminal (and the trace PNG) exactly as written, while
the project's own colours stay. As a user meets it: ``bootstrap run`` as a console script, a
stage failure through ``bootstrap.cli.main``, ``bootstrap trace FILE``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.exits import BAD_INPUT, STAGE_FAILED
from bootstrap.cli.main import main

ROOT = Path(__file__).parents[2]
MESSAGES = [
    "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: not enough memory",
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:29500",
    "[red]x[/red] and [/bold] and [bold]y",
]


def bootstrap_run(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "bootstrap.cli", "run", "--device", "cpu", "--no-plan-cache", *argv]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "COLUMNS": "400"}
    )


@pytest.mark.parametrize("broken", ["missing", "bad config.json"])
def test_a_model_path_with_brackets_fails_with_its_paragraph_and_the_path_verbatim(broken, tmp_path):
    model = tmp_path / "odd[" / "llama]"  # the path reads 'odd[/llama]', a closing tag to rich
    if broken != "missing":
        model.mkdir(parents=True)
        (model / "config.json").write_text("{not json")
    proc = bootstrap_run("--model", str(model))
    assert proc.returncode == BAD_INPUT, proc.stderr
    assert "Traceback" not in proc.stderr and "MarkupError" not in proc.stderr
    paragraph = [line for line in proc.stderr.splitlines() if line.startswith("bootstrap: ")]
    assert len(paragraph) == 1 and str(model) in paragraph[0]
    assert "  resolve_classes    failed" in proc.stderr.splitlines()  # its error: the paragraph alone


class FailingLoad(SimBackend):
    """A simulated GPU whose weight load raises the library's words."""

    def __init__(self, message: str) -> None:
        super().__init__(sim_device("h100-80gb"))
        self.message = message

    def load_model(self, config, resolved, undo):
        raise RuntimeError(self.message)


@pytest.mark.parametrize("message", MESSAGES)
def test_a_stage_failure_message_is_shown_verbatim_in_the_progress_and_the_paragraph(message, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")  # one progress line per event, unwrapped
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: FailingLoad(message))
    code = main(["run", "--model", "llama-3.1-8b", "--no-plan-cache"])
    err = capsys.readouterr().err
    assert code == STAGE_FAILED, err
    assert "  load_model         failed" in err.splitlines()
    assert f"bootstrap: failed at stage 'load_model' after 1 attempt: {message}" in err
    assert err.count(message) == 1  # once, in the paragraph
    assert "bootstrap: bootstrap" not in err
    assert "Traceback" not in err


def test_progress_marks_keep_their_colours():
    from bootstrap.pipeline.events import StageEvent

    line = run_command.progress_line(StageEvent("profiling", "attempt_failed", 1, "[red]x[/red]"))
    assert line.plain == "  profiling          attempt failed [red]x[/red]"
    assert [(line.plain[s.start : s.end], str(s.style)) for s in line.spans] == [("attempt failed", "yellow")]


def span(name: str, span_id: str, parent: str | None, start: int, end: int, **attributes: object) -> dict:
    message = attributes.pop("message", None)
    event = {"name": "exception", "time_unix_nano": end, "attributes": {"exception.message": message}}
    return {
        "name": name,
        "trace_id": "t" * 32,
        "span_id": span_id,
        "parent_span_id": parent,
        "start_time_unix_nano": start,
        "end_time_unix_nano": end,
        "status": "ERROR" if message else "OK",
        "attributes": attributes,
        "events": [event] if message else [],
    }


@pytest.fixture
def marked_trace(tmp_path) -> Path:
    """A run whose stage and attempt spans carry markup-like and mathtext-like text."""
    path = tmp_path / "odd[" / "x].jsonl"
    path.parent.mkdir()
    stage = "bootstrap.stage.load_[/bold]"
    records = [
        span(
            f"{stage}.attempt",
            "a1",
            "s1",
            10,
            20,
            **{
                "bootstrap.attempt": 1,
                "error.type": "[red]x[/red]",
                "message": "[enforce fail at alloc_cpu.cpp:127] $\\frac$",
            },
        ),
        span(f"{stage}.attempt", "a2", "s1", 20, 30, **{"bootstrap.attempt": 2, "bootstrap.adapt.x": "[/bold] -> 1"}),
        span(stage, "s1", "r1", 10, 30, **{"bootstrap.attempts": 2}),
        span(
            "bootstrap.stage.warmup",
            "s2",
            "r1",
            30,
            40,
            **{"bootstrap.skip_reason": "[dim]$x$[/dim]", "bootstrap.outcome": "skipped"},
        ),
        span("bootstrap.pipeline", "r1", None, 10, 40, **{"bootstrap.outcome": "ok"}),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_trace_view_shows_span_text_verbatim(marked_trace, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["trace", str(marked_trace)]) == 0
    out, err = capsys.readouterr()
    assert not err
    for text in (
        "load_[/bold]",
        "[red]x[/red]: [enforce fail at alloc_cpu.cpp:127] $\\frac$",
        "x: [/bold] -> 1",
        "skipped: [dim]$x$[/dim]",
        f"{marked_trace} (",
    ):
        assert text in out, text


def test_the_trace_png_draws_span_text_as_written(marked_trace, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main(["trace", str(marked_trace), "--png", str(png)]) == 0  # '$\frac$' is no mathtext to parse
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "Traceback" not in capsys.readouterr().err
