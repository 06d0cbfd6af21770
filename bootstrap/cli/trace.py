"""``bootstrap trace FILE [FILE ...] [--png OUT]``: a timeline of stages and attempts, read from
``--trace-file`` JSON Lines (``docs/design.md``), in the terminal and as a PNG.

Each file becomes one timeline: a row per pipeline run, per stage and, for a stage that took more
than one attempt, per attempt, placed by start and end time from the start of the file's first
span. Several files (a cold and a warm start, say) share one time scale, so their bars compare
directly. The PNG needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bootstrap.config import ConfigError
from bootstrap.pipeline.process import PHASE_PREFIX, PROCESS_SPAN
from bootstrap.pipeline.telemetry import ROOT_SPAN, MissingExtra

STAGE_PREFIX = "bootstrap.stage."
ATTEMPT_SUFFIX = ".attempt"
CONTRACT_KEYS = ("name", "span_id", "parent_span_id", "start_time_unix_nano", "end_time_unix_nano", "status", "attributes")
COLORS = {"ok": "green", "failed": "red", "cancelled": "dark_orange", "skipped": "bright_black", "unfinished": "blue"}
PNG_COLORS = {"ok": "#2e7d32", "failed": "#c62828", "cancelled": "#ef6c00", "skipped": "#9e9e9e"}
LABEL_COLUMNS = 72  # what the other columns of the table take, besides the bar and the note


class TraceFileError(ConfigError):
    """A trace file that cannot be read as bootstrap spans; the message names the file and line."""


@dataclass(frozen=True)
class Bar:
    """One row of a timeline: a run, a stage or an attempt, in seconds from the file's start."""

    label: str
    level: int  # 0 run, 1 stage, 2 attempt
    start_s: float
    end_s: float
    outcome: str
    note: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    source: str
    bars: list[Bar]

    @property
    def end_s(self) -> float:
        return max((b.end_s for b in self.bars), default=0.0)


# ---- reading --------------------------------------------------------------------------------


def read_spans(path: Path) -> list[dict[str, Any]]:
    """Every span of a trace file; ``TraceFileError`` for a missing file or a line that is not one."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceFileError(f"trace file {str(path)!r}: {exc.strerror or exc}") from None
    spans = [_parse_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not any(s["name"] == ROOT_SPAN or s["name"].startswith(STAGE_PREFIX) for s in spans):
        raise TraceFileError(f"trace file {str(path)!r} holds no bootstrap spans (write one with --trace-file)")
    return spans


def _parse_line(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        span = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFileError(f"trace file {str(path)!r}, line {number}: not JSON ({exc.msg})") from None
    missing = [k for k in CONTRACT_KEYS if not isinstance(span, dict) or k not in span]
    if missing:
        raise TraceFileError(f"trace file {str(path)!r}, line {number}: not a span (missing {', '.join(missing)})")
    return span


# ---- the timeline ---------------------------------------------------------------------------


def timeline(spans: Sequence[dict[str, Any]], source: str = "") -> Timeline:
    """The process (when the command traced it: ``bootstrap.pipeline.process``) and its phases,
    runs, stages and (when a stage took more than one) attempts, in start order. A run whose
    root span is missing (the process ended before the run did) is shown as ``unfinished``."""
    t0 = min(s["start_time_unix_nano"] for s in spans)
    children = _by_parent(spans)
    blocks: list[tuple[int, list[Bar]]] = []
    for run_number, root in enumerate(_sorted([*_roots(spans), *_missing_roots(spans, children)]), 1):
        bars = [_bar(root, t0, f"pipeline run {run_number}", 0)]
        for stage in _sorted(s for s in children.get(root["span_id"], []) if _is_stage(s)):
            bars.append(_bar(stage, t0, stage["name"].removeprefix(STAGE_PREFIX), 1, _stage_note(stage)))
            attempts = [s for s in children.get(stage["span_id"], []) if s["name"].endswith(ATTEMPT_SUFFIX)]
            if len(attempts) > 1:
                bars += [_bar(a, t0, f"attempt {_attempt_number(a)}", 2, _attempt_note(a)) for a in _sorted(attempts)]
        blocks.append((root["start_time_unix_nano"], bars))
    for phase in (s for s in spans if s["name"].startswith(PHASE_PREFIX)):
        blocks.append((phase["start_time_unix_nano"], [_bar(phase, t0, phase["name"].removeprefix(PHASE_PREFIX), 0)]))
    process = [_bar(p, t0, "process", 0, _coverage_note(spans, p)) for p in spans if p["name"] == PROCESS_SPAN]
    return Timeline(source, process + [bar for _, bars in sorted(blocks, key=lambda b: b[0]) for bar in bars])


def coverage(spans: Sequence[dict[str, Any]], process: dict[str, Any]) -> dict[str, float] | None:
    """The share of spawn → ready and of ready → the process span's end that the process's
    child spans cover (ready: the end of its last pipeline run); None without a finished run."""
    runs = [s for s in spans if s["name"] == ROOT_SPAN and s["parent_span_id"] == process["span_id"]]
    if not runs:
        return None
    children = sorted((s["start_time_unix_nano"], s["end_time_unix_nano"]) for s in spans
                      if s["parent_span_id"] == process["span_id"])  # fmt: skip
    ready = max(s["end_time_unix_nano"] for s in runs)
    spawn, end = process["start_time_unix_nano"], process["end_time_unix_nano"]
    return {"to_ready": _covered(children, spawn, ready) / max(ready - spawn, 1),
            "after_ready": _covered(children, ready, end) / max(end - ready, 1)}  # fmt: skip


def _covered(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Nanoseconds of [lo, hi] inside the union of ``intervals`` (sorted by start)."""
    total, reach = 0, lo
    for start, end in intervals:
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total, reach = total + end - start, end
    return total


def _coverage_note(spans: Sequence[dict[str, Any]], process: dict[str, Any]) -> str:
    share = coverage(spans, process)
    if share is None:
        return "spawn to exit"
    return f"spans cover {share['to_ready']:.0%} to ready, {share['after_ready']:.0%} after"


def _roots(spans: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == ROOT_SPAN]


def _missing_roots(spans: Sequence[dict[str, Any]], children: dict[str | None, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A stand-in root for stage spans whose parent never reached the file, over their extent."""
    known = {s["span_id"] for s in spans}
    orphans = {s["parent_span_id"] for s in spans if _is_stage(s) and s["parent_span_id"] not in known}
    return [
        {"name": ROOT_SPAN, "span_id": parent, "status": "UNSET", "attributes": {"bootstrap.outcome": "unfinished"},
         "start_time_unix_nano": min(s["start_time_unix_nano"] for s in children[parent]),
         "end_time_unix_nano": max(s["end_time_unix_nano"] for s in children[parent])}
        for parent in orphans
    ]  # fmt: skip


def _by_parent(spans: Iterable[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    out: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        out.setdefault(span["parent_span_id"], []).append(span)
    return out


def _sorted(spans: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(spans, key=lambda s: s["start_time_unix_nano"])


def _is_stage(span: dict[str, Any]) -> bool:
    return span["name"].startswith(STAGE_PREFIX) and not span["name"].endswith(ATTEMPT_SUFFIX)


def _bar(span: dict[str, Any], t0: int, label: str, level: int, note: str = "") -> Bar:
    start = (span["start_time_unix_nano"] - t0) / 1e9
    end = (span["end_time_unix_nano"] - t0) / 1e9
    return Bar(label, level, start, end, _outcome(span), note)


def _outcome(span: dict[str, Any]) -> str:
    outcome = span["attributes"].get("bootstrap.outcome")
    if outcome:
        return str(outcome)
    return "failed" if span["status"] == "ERROR" else "ok"


def _attempt_number(span: dict[str, Any]) -> int:
    return int(span["attributes"].get("bootstrap.attempt", 0))


def _stage_note(span: dict[str, Any]) -> str:
    attrs = span["attributes"]
    if attrs.get("bootstrap.skip_reason"):
        return f"skipped: {attrs['bootstrap.skip_reason']}"
    attempts = attrs.get("bootstrap.attempts", 1)
    return f"{attempts} attempts" if attempts != 1 else _error(span)


def _attempt_note(span: dict[str, Any]) -> str:
    changes = [f"{k.removeprefix('bootstrap.adapt.')}: {v}" for k, v in span["attributes"].items()
               if k.startswith("bootstrap.adapt.")]  # fmt: skip
    return "; ".join([*changes, _error(span)] if _error(span) else changes)


def _error(span: dict[str, Any]) -> str:
    kind = span["attributes"].get("error.type")
    if not kind:
        return ""
    messages = [e.get("attributes", {}).get("exception.message", "") for e in span.get("events", [])]
    message = next((m for m in messages if m), "")
    return f"{kind}: {message}"[:100] if message else str(kind)


# ---- terminal -------------------------------------------------------------------------------


def bar_width(console_width: int) -> int:
    """Characters for the bar: what the console leaves beside the other columns, 12 to 60."""
    return max(12, min(60, console_width - LABEL_COLUMNS - 20))


def timeline_table(line: Timeline, scale_s: float | None = None, width: int = 40) -> Table:
    """A rich table: label, outcome, start and duration in ms, a bar on a shared scale, notes."""
    scale = scale_s or line.end_s or 1.0
    table = Table(title=f"{line.source} ({line.end_s * 1000:.1f} ms)" if line.source else None)
    for column, justify in (("span", "left"), ("outcome", "left"), ("start", "right"), ("duration", "right"),
                            ("timeline", "left"), ("note", "left")):  # fmt: skip
        table.add_column(column, justify=justify, no_wrap=column != "note", overflow="fold")
    for bar in line.bars:
        table.add_row(
            "  " * bar.level + bar.label, Text(bar.outcome, style=COLORS.get(bar.outcome, "")),
            f"{bar.start_s * 1000:.1f} ms", f"{bar.duration_s * 1000:.1f} ms", _text_bar(bar, scale, width), bar.note,
        )  # fmt: skip
    return table


def _text_bar(bar: Bar, scale_s: float, width: int) -> Text:
    begin = min(int(bar.start_s / scale_s * width), width - 1)
    length = max(round(bar.duration_s / scale_s * width), 1)
    text = Text(" " * begin)
    text.append("█" * min(length, width - begin), style=COLORS.get(bar.outcome, ""))
    return text


# ---- PNG ------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtra("the PNG timeline needs matplotlib: pip install 'executor-bootstrap[plot]'") from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def write_png(lines: Sequence[Timeline], out: Path) -> Path:
    """One panel per timeline, stacked, on one time axis (seconds); bars coloured by outcome."""
    plt = _pyplot()
    heights = [max(len(line.bars), 1) * 0.32 + 0.8 for line in lines]
    fig, axes = plt.subplots(len(lines), 1, figsize=(11, sum(heights)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, line in zip(axes[:, 0], lines):
        _draw(ax, line)
    axes[-1, 0].set_xlabel("seconds since the first span")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def _draw(ax: Any, line: Timeline) -> None:
    for row, bar in enumerate(line.bars):
        ax.barh(row, max(bar.duration_s, 1e-4), left=bar.start_s, color=PNG_COLORS.get(bar.outcome, "#1565c0"),
                height=0.6 if bar.level else 0.8)  # fmt: skip
        ax.text(bar.end_s, row, f"  {bar.duration_s * 1000:.0f} ms {bar.note[:60]}", va="center", fontsize=7)
    ax.set_yticks(range(len(line.bars)), [("· " if b.level == 2 else "") + b.label for b in line.bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"{line.source}: {line.end_s:.3f} s", fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


# ---- the command ----------------------------------------------------------------------------


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="trace files written with --trace-file")
    parser.add_argument("--png", type=Path, help="also draw the timelines, one panel per file, into this PNG (default: none)")


def main_trace(args: argparse.Namespace, console: Console | None = None) -> int:
    """Exit status 0, or 2 for an unreadable trace file or a missing plot extra (one line on stderr)."""
    console = console or Console()
    try:
        lines = [timeline(read_spans(path), str(path)) for path in args.files]
        if args.png is not None:
            write_png(lines, args.png)
    except (TraceFileError, MissingExtra) as exc:
        print(f"bootstrap: {exc}", file=sys.stderr)
        return 2
    scale = max(line.end_s for line in lines)
    for line in lines:
        console.print(timeline_table(line, scale, bar_width(console.width)))
    if args.png is not None:
        print(f"wrote {args.png}")
    return 0
