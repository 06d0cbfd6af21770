"""``bootstrap trace`` on the trace of a live executor's operations: a real ``Bootstrap`` on tiny
checkpoints starts, swaps, is refused a weights update, sleeps, wakes, fails a swap and resumes
it; each operation (its own root span: ``bootstrap.swap``, ...) follows the start with its
detail, outcome, duration and its stage rows, in the timeline, the terminal and the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from helpers.tiny_models import save_checkpoint

from bootstrap.api import Bootstrap, Refused
from bootstrap.cli.main import main
from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.timeline import timeline
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import StageFailed
from bootstrap.stages import STAGE_IDS

MARKUP = "[bold]gone[/bold] <b>"  # a folder name rich or a browser would read as markup
ONE_OFF = ("check_weights", "read_weights", "offload_weights", "restore_weights", "check_room")


def config(path: Path) -> BootstrapConfig:
    return BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, max_batch_size=4)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The trace file of a start and seven operations, and the checkpoints they used."""
    from bootstrap.backends.native.backend import NativeBackend

    root = tmp_path_factory.mktemp("operations")
    paths = {
        "llama": save_checkpoint("llama", root / "llama"),
        "qwen": save_checkpoint("qwen2", root / "qwen2"),
        "missing": root / MARKUP,
    }
    real, fail = NativeBackend.build_final, {"left": 0}

    def failing_once(self, *args, **kwargs):
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("the pools could not be made")
        return real(self, *args, **kwargs)

    async def operate() -> None:
        boot = Bootstrap(config(paths["llama"]), trace_file=root / "serve.jsonl")
        try:
            await boot.build()
            await boot.swap(config(paths["qwen"]))
            with pytest.raises(Refused):
                await boot.update_weights(paths["missing"])
            await boot.sleep(1)
            await boot.wake()
            fail["left"] = 1
            with pytest.raises(StageFailed):
                await boot.swap(config(paths["llama"]))
            await boot.retry()
        finally:
            await boot.aclose()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NativeBackend, "build_final", failing_once)
        anyio.run(operate)
    return root / "serve.jsonl", paths


def blocks(bars):
    """Each level-0 row (a run or an operation) with the rows under it."""
    out = []
    for bar in bars:
        if bar.level == 0:
            out.append((bar, []))
        else:
            out[-1][1].append(bar)
    return out


def test_each_operation_follows_the_start_with_its_detail_outcome_and_stage_rows(served):
    path, paths = served
    shown = blocks(timeline(read_spans(path)).bars)
    assert [(run.label, run.outcome, run.note) for run, _ in shown] == [
        ("pipeline run 1", "ok", ""),
        ("swap", "ok", f"model={paths['qwen']}"),
        ("weights", "refused", f"path={paths['missing']}"),
        ("sleep", "ok", "level=1"),
        ("wake", "ok", "level=1"),
        ("swap", "failed", f"model={paths['llama']}; failed at final_build"),
        ("swap", "ok", "resumed"),
    ]
    stages = [
        [(b.label, b.outcome) for b in rows if b.level == 1 and b.label in ONE_OFF + STAGE_IDS] for _, rows in shown
    ]
    done = [(s, "skipped" if s == "warmup" else "ok") for s in STAGE_IDS]  # a CPU captures no CUDA graphs
    assert stages[0] == stages[1] == done  # the swap: resolve_classes while the old model served, then the rest
    assert stages[2] == [("check_weights", "failed")]
    assert stages[3] == [("offload_weights", "ok")]
    assert stages[4] == [("restore_weights", "ok"), ("check_room", "ok"), *done[-3:]]
    assert stages[5] == [*done[:6], ("final_build", "failed")]
    assert stages[6] == done[-3:]  # resumed at the failed stage
    assert shown[2][1][0].note.startswith(f"ConfigError: path: '{paths['missing']}'")
    for run, rows in shown:
        assert all(run.start_s <= b.start_s <= b.end_s <= run.end_s for b in rows), run.label
    assert [run.start_s for run, _ in shown] == sorted(run.start_s for run, _ in shown)


def test_an_operations_parts_that_are_no_stage_are_rows_of_it_too(served):
    """Its drain and release, say: every child span of the root but its stages, in start order with them."""
    path, _ = served
    spans = read_spans(path)
    roots = sorted((s for s in spans if s["parent_span_id"] is None), key=lambda s: s["start_time_unix_nano"])
    shown = blocks(timeline(spans).bars)
    assert len(roots) == len(shown)
    for root, (run, rows) in zip(roots, shown):
        children = sorted(
            (s for s in spans if s["parent_span_id"] == root["span_id"]), key=lambda s: s["start_time_unix_nano"]
        )
        names = [s["name"].removeprefix("bootstrap.stage.").removeprefix("bootstrap.") for s in children]
        assert [b.label for b in rows if b.level == 1] == names, run.label


def test_an_operation_row_spans_its_root_span(served):
    path, _ = served
    spans = read_spans(path)
    t0 = min(s["start_time_unix_nano"] for s in spans)
    roots = [s for s in spans if s["name"] in ("bootstrap.pipeline", "bootstrap.sleep")]
    assert [s["parent_span_id"] for s in roots] == [None, None]  # separate traces
    sleep = next(s for s in roots if s["name"] == "bootstrap.sleep")
    bar = next(b for b in timeline(spans).bars if b.label == "sleep")
    assert bar.start_s == (sleep["start_time_unix_nano"] - t0) / 1e9
    assert bar.duration_s == pytest.approx((sleep["end_time_unix_nano"] - sleep["start_time_unix_nano"]) / 1e9)


def test_the_terminal_lists_each_operation_after_the_start_text_as_written(served, capsys, monkeypatch):
    path, paths = served
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    cells = [line.split("│")[1][1:] for line in out.splitlines() if line.startswith("│")]  # after its padding
    level0 = [cell.strip() for cell in cells if cell.strip() and not cell.startswith(" ")]  # stages are indented
    assert level0 == ["pipeline run 1", "swap", "weights", "sleep", "wake", "swap", "swap"]
    assert f"path={paths['missing']}" in out  # rich markup in the detail shown as written
    assert "refused" in out and "failed at final_build" in out and "offload_weights" in out and "check_room" in out


def test_png_draws_the_operations(served, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = served
    out = tmp_path / "operations.png"
    assert main(["trace", str(path), "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_file_of_one_operation_root_alone_is_read(tmp_path):
    """A server whose trace file was opened after its start (or lost its stage lines) still shows its operation."""
    span = {
        "name": "bootstrap.sleep",
        "trace_id": "0" * 31 + "1",
        "span_id": "0" * 15 + "1",
        "parent_span_id": None,
        "start_time_unix_nano": 1_000_000_000,
        "end_time_unix_nano": 1_250_000_000,
        "status": "OK",
        "attributes": {"bootstrap.operation.detail": "level=2", "bootstrap.outcome": "ok"},
        "events": [],
    }
    path = tmp_path / "sleep.jsonl"
    path.write_text(json.dumps(span) + "\n")
    bars = timeline(read_spans(path)).bars
    assert [(b.label, b.outcome, b.note, b.duration_s) for b in bars] == [("sleep", "ok", "level=2", 0.25)]
