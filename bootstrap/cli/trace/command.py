"""``bootstrap trace FILE [FILE ...] [--png OUT] [--requests N]``: a timeline of stages and
attempts, read from ``--trace-file`` JSON Lines (``docs/design.md``), in the terminal and as a
PNG; for a ``bootstrap serve`` trace, its requests too, the slowest first (``trace.requests``).

Each file becomes one timeline: a row per pipeline run and per live operation (a server's swap,
weights, sleep, wake: its detail as the note), per stage and, for a stage that took more than
one attempt, per attempt, placed by time from the start of the file's first span. Several
files (a cold and a warm start, say) share one time scale. The PNG needs matplotlib (the
``plot`` extra). A damaged file shows what can be read (``trace.spans``): a line cut short, not
UTF-8, not JSON, or with a field of the wrong type is left out, with one warning per kind of
damage and its count on stderr; a stage of which only attempts survived shows ``unfinished``.
Exit status 2 (one line) only when a file cannot be opened or holds no readable bootstrap span,
or ``--png`` cannot be written (checked before anything is drawn). Text from the file is shown
as written: never read as rich markup, nor as matplotlib mathtext.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bootstrap.cli.args import check_values_given
from bootstrap.cli.trace.png import check_png_path, printable, special_kind, write_png
from bootstrap.cli.trace.requests import DEFAULT_SHOWN, RequestRow, fitted_requests_table, request_rows
from bootstrap.cli.trace.spans import Skipped, TraceFileError, read_spans
from bootstrap.cli.trace.timeline import Bar, Timeline, timeline
from bootstrap.config import ConfigError
from bootstrap.pipeline.telemetry import MissingExtra

COLORS = {
    "ok": "green",
    "failed": "red",
    "cancelled": "dark_orange",
    "refused": "magenta",
    "skipped": "bright_black",
    "unfinished": "blue",
}
BAR_MIN, BAR_MAX = 12, 60  # the timeline bar's characters


# ---- terminal -------------------------------------------------------------------------------


TIMELINE_COLUMNS = ("span", "outcome", "start", "duration", "timeline")
NARROW_DROPPED = ("start", "timeline")  # in this order, where the console is too narrow for them


def timeline_view(line: Timeline, scale_s: float, console_width: int) -> list[Table | Text]:
    """The timeline within ``console_width``, no word cut: the notes in their column when it gets
    their longest word beside a bar of ``BAR_MIN``; else numbered there and written out whole
    under the table, wrapped at their spaces; where even the numbers leave no ``BAR_MIN``, the
    start column goes (the bar places the span), then the bar."""
    cells = {
        "span": ["  " * b.level + b.label for b in line.bars],
        "outcome": [b.outcome for b in line.bars],
        "start": [_ms(b.start_s) for b in line.bars],
        "duration": [_ms(b.duration_s) for b in line.bars],
    }
    noted = [b for b in line.bars if b.note]
    word = max((len(w) for b in noted for w in b.note.split()), default=0)
    columns = list(TIMELINE_COLUMNS)

    def bar_room(note_width: int) -> int:  # what the bar's column gets: the rest less every border
        fixed = sum(max(len(c), *(len(v) for v in cells[c]), 0) for c in columns if c != "timeline")
        return console_width - fixed - max(note_width, len("note")) - 3 * (len(columns) + 1) - 1

    if bar_room(word) >= BAR_MIN:
        return [timeline_table(line, scale_s, min(bar_room(word), BAR_MAX), note_width=word)]
    number_width = len(f"[{len(noted)}]")
    for drop in (None, *NARROW_DROPPED):
        if drop is not None:
            columns.remove(drop)
        if bar_room(number_width) >= BAR_MIN or "timeline" not in columns:
            break
    bar = max(BAR_MIN, min(bar_room(number_width), BAR_MAX))
    notes = [
        Text(part)
        for i, b in enumerate(noted, 1)
        for part in textwrap.wrap(
            f"[{i}] {b.label}: {b.note}",
            max(console_width, 20),
            subsequent_indent=" " * (len(f"[{i}] ") + 2),
            break_long_words=False,
            break_on_hyphens=False,
        )
    ]
    return [timeline_table(line, scale_s, bar, number_width, numbered=True, columns=columns), *notes]


def timeline_table(
    line: Timeline,
    scale_s: float | None = None,
    width: int = 40,
    note_width: int = 0,
    numbered: bool = False,
    columns: Sequence[str] = TIMELINE_COLUMNS,
) -> Table:
    """A rich table: label, outcome, start and duration in ms, a bar on a shared scale, notes
    (``note_width`` at least; ``numbered``: "[1]", ... for ``timeline_view`` to write out);
    ``columns``: those shown of the first five. Labels, notes and the title come from the file:
    ``Text``, never read as rich markup."""
    scale = scale_s or line.end_s or 1.0
    table = Table(title=Text(f"{line.source} ({line.end_s * 1000:.1f} ms)") if line.source else None)
    for column in columns:
        table.add_column(column, justify="right" if column in ("start", "duration") else "left", no_wrap=True)
    table.add_column("note", min_width=note_width, overflow="fold")
    number = iter(range(1, len(line.bars) + 1))
    for bar in line.bars:
        note = f"[{next(number)}]" if numbered and bar.note else bar.note
        cells = {
            "span": Text("  " * bar.level + bar.label),
            "outcome": Text(bar.outcome, style=COLORS.get(bar.outcome, "")),
            "start": _ms(bar.start_s),
            "duration": _ms(bar.duration_s),
            "timeline": _text_bar(bar, scale, width),
        }
        table.add_row(*(cells[c] for c in columns), Text(note))
    return table


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _text_bar(bar: Bar, scale_s: float, width: int) -> Text:
    begin = min(int(bar.start_s / scale_s * width), width - 1)
    length = max(round(bar.duration_s / scale_s * width), 1)
    text = Text(" " * begin)
    text.append("█" * min(length, width - begin), style=COLORS.get(bar.outcome, ""))
    return text


# ---- the command ----------------------------------------------------------------------------


def _read_timeline(path: Path) -> tuple[Timeline, list[str], list[RequestRow]]:
    """The file's timeline, what it had to leave out (one warning per kind of damage) and its
    requests, slowest first. A FIFO or device is refused before it is opened (reading it would
    block, or never end)."""
    special = special_kind(path)
    if special and special != "a directory":
        raise TraceFileError(f"trace file {str(path)!r}: {special}, not a regular file")
    skipped = Skipped()
    spans = read_spans(path, skipped)
    return timeline(spans, str(path)), skipped.warnings(path), request_rows(spans)


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="trace files written with --trace-file")
    parser.add_argument(
        "--png", type=Path, help="also draw the timelines, one panel per file, into this PNG (default: none)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_SHOWN,
        metavar="N",
        help=f"show the N slowest requests of a bootstrap serve trace (default {DEFAULT_SHOWN}; 0: none)",
    )


def main_trace(args: argparse.Namespace, console: Console | None = None) -> int:
    """Exit status 0 once every file showed what it could (damaged lines: one warning per kind
    on stderr), or 2 with one line on stderr: a file that cannot be opened or holds no readable
    bootstrap span, a ``--png`` path that cannot be written, a missing plot extra."""
    console = console or Console(markup=False)
    try:
        check_values_given(args)
        if getattr(args, "requests", 0) < 0:
            raise ConfigError(f"requests: must be >= 0 (got {args.requests}); allowed: 0 (none) or more")
        if args.png is not None:
            check_png_path(args.png)
        lines, warnings, requests = zip(*(_read_timeline(path) for path in args.files))
        if args.png is not None:
            write_png(lines, args.png)
    except (ConfigError, MissingExtra) as exc:  # TraceFileError is a ConfigError
        print(f"bootstrap: {exc}", file=sys.stderr)
        return 2
    for warning in (w for file_warnings in warnings for w in file_warnings):
        print(f"bootstrap: {warning}", file=sys.stderr)
    scale = max(line.end_s for line in lines)
    for line, rows in zip(lines, requests):
        if line.bars or not rows:
            for part in timeline_view(line, scale, console.width):
                console.print(part)
        if rows and getattr(args, "requests", DEFAULT_SHOWN):
            console.print(fitted_requests_table(rows, args.requests, console.width))
    if args.png is not None:
        print(f"wrote {printable(str(args.png))}")
    return 0
