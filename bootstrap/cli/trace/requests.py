"""The requests of a ``bootstrap serve`` trace file (``bootstrap.serve.request_trace``), the
slowest first: each one's queue, prefill and decode time (its slowest choice's), tokens, status
and finish reasons, and a bar placing it on the file's request timeline, its phases coloured.
Attributes are read as written, whatever their type: a damaged one shows as ``?``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from bootstrap.pipeline.telemetry import CHOICE_SPAN, REQUEST_SPAN, request_phase_span

PHASES = ("queue", "prefill", "decode")
PHASE_COLORS = {"queue": "yellow", "prefill": "blue", "decode": "green", "server": "bright_black"}
DEFAULT_SHOWN = 20
MS_COLUMNS = ("start", "total", "queue", "prefill", "decode")
COLUMNS = ("trace", "request", "start", "total", "queue", "prefill", "decode", "tokens", "finish", "KV", "timeline")
WRAPPED = ("request", "finish")  # wrap at their spaces; every other cell stays on one line
DROPPED = ("timeline", "trace", "KV", "start")  # in this order, where the console is too narrow for them
BAR_MIN, BAR_MAX = 10, 40


@dataclass(frozen=True)
class RequestRow:
    """One traced request, in seconds from the file's first request."""

    trace_id: str
    endpoint: str
    status: str
    start_s: float
    end_s: float
    phases: dict[str, tuple[float, float]]  # its slowest choice's queue, prefill and decode: (start, end)
    tokens: str
    finish: str
    kv_blocks: str

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def request_rows(spans: Sequence[dict[str, Any]]) -> list[RequestRow]:
    """Every request span of the file, slowest first."""
    requests = [s for s in spans if s["name"] == REQUEST_SPAN]
    if not requests:
        return []
    t0 = min(s["start_time_unix_nano"] for s in requests)
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        children.setdefault(span["parent_span_id"], []).append(span)
    rows = [_row(span, t0, children) for span in requests]
    return sorted(rows, key=lambda r: r.duration_s, reverse=True)


def _row(span: dict[str, Any], t0: int, children: dict[str | None, list[dict[str, Any]]]) -> RequestRow:
    attrs = span["attributes"]
    choices = [c for c in children.get(span["span_id"], []) if c["name"] == CHOICE_SPAN]
    slowest = max(choices, key=lambda c: c["end_time_unix_nano"] - c["start_time_unix_nano"], default=None)
    phases: dict[str, tuple[float, float]] = {}
    for phase in children.get(slowest["span_id"], []) if slowest else []:
        name = next((p for p in PHASES if phase["name"] == request_phase_span(p)), None)
        if name is not None:
            phases[name] = ((phase["start_time_unix_nano"] - t0) / 1e9, (phase["end_time_unix_nano"] - t0) / 1e9)
    reasons = attrs.get("gen_ai.response.finish_reasons")
    finish = ", ".join(map(str, reasons)) if isinstance(reasons, list) else ("" if reasons is None else "?")
    blocks = [c["attributes"].get("bootstrap.kv_blocks") for c in choices]
    return RequestRow(
        str(span.get("trace_id", "?"))[:8],
        _text(attrs.get("bootstrap.endpoint") or attrs.get("url.path")),
        _text(attrs.get("http.response.status_code")),
        (span["start_time_unix_nano"] - t0) / 1e9,
        (span["end_time_unix_nano"] - t0) / 1e9,
        phases,
        f"{_text(attrs.get('gen_ai.usage.input_tokens'))}→{_text(attrs.get('gen_ai.usage.output_tokens'))}",
        finish,
        "+".join(_text(b) for b in blocks),
    )


def _text(value: Any) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else "?"


def requests_table(
    rows: Sequence[RequestRow], shown: int = DEFAULT_SHOWN, width: int = 40, columns: Sequence[str] = COLUMNS
) -> Table:
    """The ``shown`` slowest requests: times in ms, and a bar of ``width`` on the requests' shared
    time axis; ``columns``: those shown (``fitted_requests_table`` leaves some out)."""
    scale = max((r.end_s for r in rows), default=0.0) or 1.0
    legend = "; bar: queue yellow, prefill blue, decode green, the server's own time grey"
    legend = legend if "timeline" in columns else ""
    title = f"requests, slowest first ({min(shown, len(rows))} of {len(rows)}; ms{legend})"
    table = Table(title=Text(title))
    for column in columns:
        table.add_column(column, justify="right" if column in MS_COLUMNS else "left", no_wrap=column not in WRAPPED)
    for row in rows[:shown]:
        cells = _cells(row)
        table.add_row(*(_bar(row, scale, width) if column == "timeline" else cells[column] for column in columns))
    return table


def fitted_requests_table(rows: Sequence[RequestRow], shown: int, console_width: int) -> Table:
    """``requests_table`` within ``console_width``, no header or value cut short: the bar takes
    what the other columns leave (``BAR_MIN`` to ``BAR_MAX``); where even ``BAR_MIN`` does not
    fit, columns go in ``DROPPED``'s order until the rest fits on one line a request, else
    until it fits with ``WRAPPED`` cells wrapped at their spaces."""
    cells = [_cells(row) for row in rows[:shown]]

    def natural(column: str, wrapped: bool) -> int:
        texts = [str(c[column]) for c in cells]
        words = [w for t in texts for w in t.split()] if wrapped and column in WRAPPED else texts
        return max(len(column), *(len(w) for w in words))

    for wrapped in (False, True):
        columns = list(COLUMNS)
        for drop in (None, *DROPPED):
            if drop is not None:
                columns.remove(drop)
            # what the bar's column can have: the console less the other cells and every column's borders
            rest = console_width - sum(natural(c, wrapped) for c in columns if c != "timeline") - 3 * len(columns) - 1
            if rest >= (BAR_MIN if "timeline" in columns else 0):
                return requests_table(rows, shown, max(BAR_MIN, min(rest, BAR_MAX)), columns)
    return requests_table(rows, shown, BAR_MIN, columns)


def _cells(row: RequestRow) -> dict[str, Text | str]:
    """The row's cells but the bar, as the table shows them."""
    phases = {p: _ms(_length(row.phases.get(p))) for p in PHASES}
    return {
        "trace": Text(row.trace_id),
        "request": Text(f"{row.endpoint} {row.status}"),
        "start": _ms(row.start_s),
        "total": _ms(row.duration_s),
        **phases,
        "tokens": Text(row.tokens),
        "finish": Text(row.finish),
        "KV": Text(row.kv_blocks),
    }


def _length(span: tuple[float, float] | None) -> float | None:
    return None if span is None else span[1] - span[0]


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.1f}"


def _bar(row: RequestRow, scale: float, width: int) -> Text:
    """The request's extent on the shared axis: the server's own time grey, each phase in its colour."""
    cells = ["server"] * width
    begin = min(int(row.start_s / scale * width), width - 1)
    end = max(min(round(row.end_s / scale * width), width), begin + 1)
    for phase in PHASES:
        if phase in row.phases:
            lo, hi = (min(int(t / scale * width), width - 1) for t in row.phases[phase])
            for cell in range(lo, max(hi, lo + 1)):
                cells[cell] = phase
    text = Text(" " * begin)
    for cell in range(begin, end):
        text.append("█", style=PHASE_COLORS[cells[cell]])
    return text
