"""``bootstrap trace``: timelines from trace files written by ``bootstrap plan --trace-file``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bootstrap.cli.main import main
from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.timeline import timeline
from bootstrap.stages import STAGE_IDS

PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """A start whose first profiling attempt ran out of memory, then a cold and a warm start."""
    root = tmp_path_factory.mktemp("traces")
    cache = root / "plans"
    runs = {
        "retried": ["--fault", "profiling:oom:1"],
        "cold": ["--plan-cache", str(cache)],
        "warm": ["--plan-cache", str(cache)],
    }
    for name, extra in runs.items():
        assert main([*PLAN, *extra, "--trace-file", str(root / f"{name}.jsonl")]) == 0
    return {name: root / f"{name}.jsonl" for name in runs}


def test_one_row_per_stage_in_order_and_one_per_attempt_of_a_retried_stage(traces):
    bars = timeline(read_spans(traces["retried"])).bars
    assert bars[0].label == "pipeline run 1" and bars[0].level == 0
    assert [b.label for b in bars if b.level == 1] == list(STAGE_IDS)
    attempts = [b for b in bars if b.level == 2]
    assert [(b.label, b.outcome) for b in attempts] == [("attempt 1", "failed"), ("attempt 2", "ok")]
    assert "ProbeOutOfMemory" in attempts[0].note and "probe_tokens:" in attempts[1].note
    profiling = next(b for b in bars if b.label == "profiling")
    assert profiling.note == "2 attempts"
    assert all(profiling.start_s <= a.start_s <= a.end_s <= profiling.end_s for a in attempts)
    assert all(0 <= b.start_s <= b.end_s <= bars[0].end_s for b in bars)


def test_a_warm_start_shows_the_skipped_stages(traces):
    bars = {b.label: b for b in timeline(read_spans(traces["warm"])).bars}
    for stage in ("estimation_build", "profiling"):
        assert (bars[stage].outcome, bars[stage].note) == ("skipped", "skipped: plan-cache")
    cold = {b.label: b.outcome for b in timeline(read_spans(traces["cold"])).bars}
    assert cold.pop("warmup") == "skipped"  # a simulated GPU captures no CUDA graphs
    assert set(cold.values()) == {"ok"}


def test_the_terminal_timeline_names_every_stage_and_attempt(traces, capsys):
    assert main(["trace", str(traces["retried"]), str(traces["warm"])]) == 0
    out = capsys.readouterr().out
    for stage in STAGE_IDS:
        assert stage in out
    assert "attempt 1" in out and "failed" in out and "skipped" in out
    assert str(traces["warm"]) in out and "█" in out


def test_png_of_cold_and_warm_side_by_side(traces, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "cold_warm.png"
    assert main(["trace", str(traces["cold"]), str(traces["warm"]), "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_png_without_matplotlib_is_a_clear_input_error(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["trace", str(traces["cold"]), "--png", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'executor-bootstrap[plot]'" in err and "Traceback" not in err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ("{not json\n", "line 1: not JSON"),
        ('{"name": "x"}\n', "line 1: not a span (missing span_id"),
        (
            json.dumps(
                {
                    "name": "other",
                    "span_id": "1",
                    "parent_span_id": None,
                    "start_time_unix_nano": 1,
                    "end_time_unix_nano": 2,
                    "status": "OK",
                    "attributes": {},
                }
            )
            + "\n",
            "holds no bootstrap spans",
        ),
    ],
)
def test_unreadable_trace_files_exit_2_with_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_run_cut_short_before_its_root_span_shows_as_unfinished(traces, tmp_path):
    lines = [line for line in traces["cold"].read_text().splitlines() if '"bootstrap.pipeline"' not in line]
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines) + "\n")
    bars = timeline(read_spans(cut)).bars
    assert (bars[0].label, bars[0].outcome) == ("pipeline run 1", "unfinished")
    assert [b.label for b in bars if b.level == 1] == list(STAGE_IDS)


def test_at_80_columns_no_word_of_a_note_is_cut(traces, monkeypatch, capsys):
    """Notes too long for their column beside the bar are numbered and written out under the table."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["trace", str(traces["retried"]), str(traces["warm"])]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    words = out.split()
    for name in ("retried", "warm"):
        for bar in timeline(read_spans(traces[name])).bars:
            assert all(word in words for word in bar.note.split()), bar.note
