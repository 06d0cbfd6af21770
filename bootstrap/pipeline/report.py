"""Per-stage rows for people (a rich table) and programs (``--json``), read from the spans."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from rich.table import Table

from bootstrap.devices import GiB

PREFIX = "bootstrap.stage."


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
            }
        )
    return rows


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f} GiB"


def stage_table(rows: list[dict[str, Any]], title: str = "bootstrap stages") -> Table:
    table = Table(title=title)
    table.add_column("stage", no_wrap=True, min_width=max((len(r["id"]) for r in rows), default=5))
    table.add_column("outcome")  # "skipped (plan-cache)" may wrap on a narrow terminal; stage ids never do
    for column in ("attempts", "duration", "free before", "free after"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        outcome = row["outcome"] or "-"
        if row["skip_reason"]:
            outcome += f" ({row['skip_reason']})"
        table.add_row(
            row["id"], outcome, str(row["attempts"]), f"{row['duration_s'] * 1000:.1f} ms",
            _gib(row["free_bytes_before"]), _gib(row["free_bytes_after"]),
        )  # fmt: skip
    return table
