"""Per-stage rows for people (a rich table) and programs (``--json``), read from the spans."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from rich.table import Table

from bootstrap.devices import GiB

PREFIX = "bootstrap.stage."
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
    """One row per stage span, in start order: id, outcome, attempts, duration, free memory."""
    rows = []
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
            }
        )
    return rows


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
