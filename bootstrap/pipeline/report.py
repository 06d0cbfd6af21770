"""Per-stage rows for people (a rich table) and programs (``--json``), read from the spans."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from rich.table import Table

from bootstrap.devices import GiB

PREFIX = "bootstrap.stage."
ADAPT = "bootstrap.adapt."
ROW_ATTRIBUTES = frozenset(  # a row's own columns; every other attribute is one of the stage's figures
    {
        "bootstrap.stage",
        "bootstrap.outcome",
        "bootstrap.attempts",
        "bootstrap.device.free_bytes.before",
        "bootstrap.device.free_bytes.after",
        "bootstrap.skip_reason",
    }
)


def stage_rows(spans: Iterable[ReadableSpan]) -> list[dict[str, Any]]:
    """One row per stage span, in start order: id, outcome, attempts, duration, free memory, and
    ``retries``: each attempt that failed and was retried, with its error and what the retry changed."""
    rows = []
    spans = list(spans)
    stage_spans = [s for s in spans if s.name.startswith(PREFIX) and not s.name.endswith(".attempt")]
    for span in sorted(stage_spans, key=lambda s: s.start_time or 0):
        attrs = span.attributes or {}
        rows.append(
            {
                "id": attrs.get("bootstrap.stage", span.name.removeprefix(PREFIX)),
                "outcome": attrs.get("bootstrap.outcome"),
                "attempts": attrs.get("bootstrap.attempts", 0),
                "duration_s": round(((span.end_time or 0) - (span.start_time or 0)) / 1e9, 6),
                "free_bytes_before": attrs.get("bootstrap.device.free_bytes.before"),
                "free_bytes_after": attrs.get("bootstrap.device.free_bytes.after"),
                "skip_reason": attrs.get("bootstrap.skip_reason"),
                "error": span.status.description if span.status.description else None,
                "figures": {k: v for k, v in attrs.items() if k not in ROW_ATTRIBUTES},
                "retries": _retries(span, spans),
            }
        )
    return rows


def _retries(stage: ReadableSpan, spans: list[ReadableSpan]) -> list[dict[str, Any]]:
    """The stage's failed attempts that another attempt followed: attempt number, error, and the
    next attempt's adaptation (``bootstrap.adapt.*``) in words, or None for a retry unchanged."""
    stage_id = stage.context.span_id if stage.context is not None else None
    mine = [s for s in spans if s.name == f"{stage.name}.attempt" and s.parent and s.parent.span_id == stage_id]
    attempts = sorted(mine, key=lambda s: (s.attributes or {}).get("bootstrap.attempt", 0))
    retries = []
    for failed, following in itertools.pairwise(attempts):
        attrs = following.attributes or {}
        changes = [f"{k.removeprefix(ADAPT)}: {v}" for k, v in attrs.items() if k.startswith(ADAPT)]
        retries.append(
            {
                "attempt": (failed.attributes or {}).get("bootstrap.attempt"),
                "error": _error_of(failed),
                "change": ", ".join(changes) or None,
            }
        )
    return retries


def _error_of(span: ReadableSpan) -> str:
    """``Type: message`` from the span's exception event (its status description as a fallback)."""
    for event in span.events:
        if event.name == "exception" and event.attributes:
            kind = str(event.attributes.get("exception.type", "")).rsplit(".", 1)[-1]
            message = str(event.attributes.get("exception.message", ""))
            return f"{kind}: {message}" if kind else message
    return span.status.description or "failed"


def retry_lines(rows: list[dict[str, Any]], width: int) -> list[str]:
    """Each retry in words under the stage table, wrapped at ``width`` between words only (a
    word longer than a line stays whole): the attempt's error, then what the retry changed."""
    lines = []
    for row in rows:
        for retry in row.get("retries") or ():
            change = f"retried with {retry['change']}" if retry["change"] else "retried unchanged"
            for text, indent in ((f"{row['id']} attempt {retry['attempt']} failed: {retry['error']}", 2), (change, 4)):
                lines += textwrap.wrap(
                    text,
                    max(width, 20),
                    initial_indent=" " * indent,
                    subsequent_indent=" " * (indent + 2),
                    break_long_words=False,
                    break_on_hyphens=False,
                )
    return lines


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def stage_table(rows: list[dict[str, Any]], title: str = "bootstrap stages") -> Table:
    """Fits 80 columns: stage ids never wrap, an outcome with a reason wraps at its space
    ("skipped" over "(plan-cache)"), and no header is cut short."""
    table = Table(title=title, caption="before, after: free device memory in GiB")
    table.add_column("stage", no_wrap=True, min_width=max((len(r["id"]) for r in rows), default=5))
    outcomes = [_outcome(row) for row in rows]
    table.add_column("outcome", min_width=max((len(w) for o in outcomes for w in o.split()), default=7))
    for column in ("tries", "time", "before", "after"):
        table.add_column(column, justify="right")
    for row, outcome in zip(rows, outcomes):
        table.add_row(
            row["id"],
            outcome,
            str(row["attempts"]),
            duration(row["duration_s"]),
            _gib(row["free_bytes_before"]),
            _gib(row["free_bytes_after"]),
        )
    return table


def _outcome(row: dict[str, Any]) -> str:
    outcome = row["outcome"] or "-"
    return f"{outcome} ({row['skip_reason']})" if row["skip_reason"] else outcome


def duration(seconds: float) -> str:
    """``22.7 ms`` under a second, ``11.82 s`` from there."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
