"""Reading ``--trace-file`` JSON Lines (``docs/design.md``) into spans, damaged files included.

A line cut short (a writer that was killed), not UTF-8, not JSON, or with a field of the wrong
type is left out and counted in ``Skipped``, per kind of damage, so ``bootstrap trace`` shows
what can be read and warns about the rest. ``TraceFileError`` only for a file that cannot be
opened or holds no readable bootstrap span.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bootstrap.config import ConfigError, is_int
from bootstrap.pipeline.telemetry import is_request_span, is_root_span

STAGE_PREFIX = "bootstrap.stage."
CONTRACT_KEYS = (
    "name",
    "span_id",
    "parent_span_id",
    "start_time_unix_nano",
    "end_time_unix_nano",
    "status",
    "attributes",
)


class TraceFileError(ConfigError):
    """A trace file that cannot be read as bootstrap spans; the message names the file and line."""


@dataclass
class Skipped:
    """What a damaged file lost, per kind of damage: its line numbers and the first one's detail.
    A file cut short by a killed writer loses its last line, not the spans before it."""

    lines: dict[str, list[int]] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)  # kinds whose span is still shown (without the bad part)

    def add(self, kind: str, number: int, detail: str = "", kept: bool = False) -> None:
        self.lines.setdefault(kind, []).append(number)
        self.details.setdefault(kind, detail)
        if kept:
            self.kept.add(kind)

    def describe(self, kind: str) -> str:
        numbers, detail = self.lines[kind], self.details[kind]
        where = f"line {numbers[0]}" if len(numbers) == 1 else f"{len(numbers)} lines (first: line {numbers[0]})"
        return f"{where}: {kind}" + (f" ({detail})" if detail else "")

    def warnings(self, path: Path) -> list[str]:
        """One line per kind of damage, for stderr."""
        return [
            f"trace file {str(path)!r}: {self.describe(kind)}; "
            f"{'shown without them' if kind in self.kept else 'skipped'}"
            for kind in self.lines
        ]


def read_spans(path: Path, skipped: Skipped | None = None) -> list[dict[str, Any]]:
    """Every span of a trace file that can be read; a line that cannot (cut short, not UTF-8,
    not JSON, a field of the wrong type) is left out and counted in ``skipped``.
    ``TraceFileError`` for a file that cannot be opened or holds no readable bootstrap span."""
    skipped = Skipped() if skipped is None else skipped
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TraceFileError(f"trace file {str(path)!r}: {exc.strerror or exc}") from None
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    cut = len(lines) if lines[-1].strip() else 0  # a last line without its newline: the writer stopped
    spans = []
    for number, raw in enumerate(lines, 1):
        span = _parse_line(raw, number, number == cut, skipped) if raw.strip() else None
        if span is not None:
            spans.append(span)
    if not any(
        is_root_span(s["name"]) or s["name"].startswith(STAGE_PREFIX) or is_request_span(s["name"]) for s in spans
    ):
        damage = "; ".join(skipped.describe(kind) for kind in skipped.lines)
        why = f" that can be read: {damage}" if damage else " (write one with --trace-file)"
        raise TraceFileError(f"trace file {str(path)!r} holds no bootstrap spans{why}")
    return spans


def _parse_line(raw: bytes, number: int, last: bool, skipped: Skipped) -> dict[str, Any] | None:
    """The span on one line, or None (counted in ``skipped``)."""
    try:
        span = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        if last:
            skipped.add("cut short", number, "the last line has no end: the writer stopped mid-line")
        elif isinstance(exc, UnicodeDecodeError):
            skipped.add("not UTF-8 text", number, f"byte {exc.start}")
        else:
            skipped.add("not JSON", number, getattr(exc, "msg", "nested too deeply"))
        return None
    problem = _problem(span)
    if problem is not None:
        kind, detail = problem
        skipped.add(kind, number, detail)
        return None
    return _with_valid_events(span, number, skipped)


def _problem(span: Any) -> tuple[str, str] | None:
    """Why ``span`` is not one: (kind, detail), naming the field and what it must be; or None."""
    if not isinstance(span, dict):
        return "not a span", f"a JSON {type(span).__name__}, not an object"
    missing = [k for k in CONTRACT_KEYS if k not in span]
    if missing:
        return "not a span", f"missing {', '.join(missing)}"
    for key, (valid, allowed) in FIELDS.items():
        if not valid(span[key]):
            return f"{key} is not {allowed}", f"got {_short(span[key])}"
    if span["end_time_unix_nano"] < span["start_time_unix_nano"]:
        return "end_time_unix_nano is before start_time_unix_nano", ""
    return None


def _is_nanos(value: Any) -> bool:
    return is_int(value) and 0 <= value < 2**64


FIELDS = {
    "name": (lambda v: isinstance(v, str), "a string"),
    "span_id": (lambda v: isinstance(v, str), "a string"),
    "parent_span_id": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "start_time_unix_nano": (_is_nanos, "nanoseconds (an integer in [0, 2**64))"),
    "end_time_unix_nano": (_is_nanos, "nanoseconds (an integer in [0, 2**64))"),
    "status": (lambda v: isinstance(v, str), "a string"),
    "attributes": (lambda v: isinstance(v, dict), "an object"),
}


def _with_valid_events(span: dict[str, Any], number: int, skipped: Skipped) -> dict[str, Any]:
    """``span``, its ``events`` (optional) cut to the event objects with object attributes."""
    events = span.get("events", [])
    if not isinstance(events, list):
        events = [None]  # nothing in it is an event
    valid = [e for e in events if isinstance(e, dict) and isinstance(e.get("attributes", {}), dict)]
    if len(valid) == len(events):
        return span
    skipped.add("events is not a list of event objects", number, f"got {_short(span['events'])}", kept=True)
    return {**span, "events": valid}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
