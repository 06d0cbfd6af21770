"""A trace file's spans as a timeline (``bootstrap trace``): one bar per pipeline run, live
operation, stage and retried attempt, and the process's phases with the share they cover."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bootstrap.cli.trace.png import printable
from bootstrap.cli.trace.spans import STAGE_PREFIX
from bootstrap.config import is_int
from bootstrap.pipeline.process import PHASE_PREFIX, PROCESS_SPAN
from bootstrap.pipeline.telemetry import OPERATIONS, ROOT_SPAN, is_request_span, is_root_span, operation_span

ATTEMPT_SUFFIX = ".attempt"


@dataclass(frozen=True)
class Bar:
    """One row of a timeline: a run, a stage or an attempt, in seconds from the file's start."""

    label: str
    level: int  # 0 run or operation, 1 stage, 2 attempt
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


# ---- the timeline ---------------------------------------------------------------------------


def timeline(spans: Sequence[dict[str, Any]], source: str = "") -> Timeline:
    """The process (when the command traced it: ``bootstrap.pipeline.process``) and its phases,
    runs and live operations (``is_root_span``; an operation's parts that are no stage, such as
    its drain, too), their stages and (when a stage took more than one) attempts, in start
    order. A run whose root span is missing (the process ended before the run did) is shown as
    ``unfinished``, and so is a stage of which only attempts reached the file."""
    spans = [*spans, *_missing_stages(spans)]
    t0 = min(s["start_time_unix_nano"] for s in spans)
    children = _by_parent(spans)
    blocks: list[tuple[int, list[Bar]]] = []
    runs = 0
    for root in _sorted([*_roots(spans), *_missing_roots(spans, children)]):
        if root["name"] == ROOT_SPAN:
            runs += 1
            bars = [_bar(root, t0, f"pipeline run {runs}", 0)]
        else:
            bars = [_bar(root, t0, OPERATION_NAMES[root["name"]], 0, _operation_note(root))]
        for child in _sorted(s for s in children.get(root["span_id"], []) if _is_stage(s) or _is_part(root, s)):
            if not _is_stage(child):
                bars.append(_bar(child, t0, child["name"].removeprefix("bootstrap."), 1, _error(child)))
                continue
            bars.append(_bar(child, t0, child["name"].removeprefix(STAGE_PREFIX), 1, _stage_note(child)))
            attempts = [s for s in children.get(child["span_id"], []) if _is_attempt(s)]
            if len(attempts) > 1:
                bars += [_bar(a, t0, f"attempt {_attempt_number(a)}", 2, _attempt_note(a)) for a in _sorted(attempts)]
        blocks.append((root["start_time_unix_nano"], bars))
    for phase in (s for s in spans if s["name"].startswith(PHASE_PREFIX)):
        blocks.append((phase["start_time_unix_nano"], [_bar(phase, t0, phase["name"].removeprefix(PHASE_PREFIX), 0)]))
    process = [_bar(p, t0, "process", 0, _coverage_note(spans, p)) for p in spans if p["name"] == PROCESS_SPAN]
    ordered = [bar for _, bars in sorted(blocks, key=lambda b: b[0]) for bar in bars]
    return Timeline(printable(source), process + ordered)


def coverage(spans: Sequence[dict[str, Any]], process: dict[str, Any]) -> dict[str, float] | None:
    """The share of spawn → ready and of ready → the process span's end that the process's
    child spans cover (ready: the end of its last pipeline run); None without a finished run."""
    runs = [s for s in spans if s["name"] == ROOT_SPAN and s["parent_span_id"] == process["span_id"]]
    if not runs:
        return None
    children = sorted(
        (s["start_time_unix_nano"], s["end_time_unix_nano"]) for s in spans if s["parent_span_id"] == process["span_id"]
    )
    ready = max(s["end_time_unix_nano"] for s in runs)
    spawn, end = process["start_time_unix_nano"], process["end_time_unix_nano"]
    return {
        "to_ready": _covered(children, spawn, ready) / max(ready - spawn, 1),
        "after_ready": _covered(children, ready, end) / max(end - ready, 1),
    }


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
    """The pipeline runs' root spans and the live operations' (each a trace of its own)."""
    return [s for s in spans if is_root_span(s["name"])]


OPERATION_NAMES = {operation_span(o): o for o in OPERATIONS}  # bootstrap.swap -> swap


def _operation_note(span: dict[str, Any]) -> str:
    """An operation's detail (``model=...``, ``level=1``) and the stage it failed at."""
    attrs = span["attributes"]
    parts = [str(attrs.get("bootstrap.operation.detail") or "")]
    if attrs.get("bootstrap.failed_stage"):
        parts.append(f"failed at {attrs['bootstrap.failed_stage']}")
    return "; ".join(p for p in parts if p)


def _missing_roots(
    spans: Sequence[dict[str, Any]], children: dict[str | None, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """A stand-in root for stage spans whose parent is not a run in the file (it never reached
    the file, or its line was damaged), over their extent."""
    known = {s["span_id"] for s in _roots(spans)}
    orphans = {s["parent_span_id"] for s in spans if _is_stage(s) and s["parent_span_id"] not in known}
    return [
        {
            "name": ROOT_SPAN,
            "span_id": parent,
            "status": "UNSET",
            "attributes": {"bootstrap.outcome": "unfinished"},
            "start_time_unix_nano": min(s["start_time_unix_nano"] for s in children[parent]),
            "end_time_unix_nano": max(s["end_time_unix_nano"] for s in children[parent]),
        }
        for parent in orphans
    ]


def _missing_stages(spans: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stand-in stage for attempt spans whose stage span never reached the file (the writer
    stopped during the stage), in the run of its trace when the file shows that run."""
    stages = {s["span_id"] for s in spans if _is_stage(s)}
    runs = {_trace_id(s): s["parent_span_id"] for s in spans if _is_stage(s)}
    runs.update({_trace_id(s): s["span_id"] for s in _roots(spans)})
    runs.pop(None, None)  # a span without a trace id tells no run
    orphans: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if _is_attempt(span) and span["parent_span_id"] not in stages:
            orphans.setdefault(span["parent_span_id"], []).append(span)
    return [
        _stand_in_stage(parent, attempts, runs.get(_trace_id(attempts[0])))
        for parent, attempts in orphans.items()
        if parent is not None
    ]


def _stand_in_stage(span_id: str, attempts: list[dict[str, Any]], run: str | None) -> dict[str, Any]:
    """An ``unfinished`` stage over its attempts, with the last one's error as its note."""
    last = max(attempts, key=lambda s: s["end_time_unix_nano"])
    error = {k: v for k, v in last["attributes"].items() if k == "error.type"}
    return {
        "name": last["name"].removesuffix(ATTEMPT_SUFFIX),
        "span_id": span_id,
        "parent_span_id": run,
        "status": "UNSET",
        "attributes": {"bootstrap.outcome": "unfinished", "bootstrap.attempts": len(attempts), **error},
        "events": last.get("events", []),
        "start_time_unix_nano": min(s["start_time_unix_nano"] for s in attempts),
        "end_time_unix_nano": last["end_time_unix_nano"],
    }


def _trace_id(span: dict[str, Any]) -> str | None:
    trace_id = span.get("trace_id")
    return trace_id if isinstance(trace_id, str) else None


def _by_parent(spans: Iterable[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    out: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        out.setdefault(span["parent_span_id"], []).append(span)
    return out


def _sorted(spans: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(spans, key=lambda s: s["start_time_unix_nano"])


def _is_stage(span: dict[str, Any]) -> bool:
    return span["name"].startswith(STAGE_PREFIX) and not span["name"].endswith(ATTEMPT_SUFFIX)


def _is_part(root: dict[str, Any], span: dict[str, Any]) -> bool:
    """A child of an operation that is no stage: its drain, its release of the old state."""
    return root["name"] != ROOT_SPAN and not span["name"].startswith(STAGE_PREFIX) and not is_request_span(span["name"])


def _is_attempt(span: dict[str, Any]) -> bool:
    return span["name"].startswith(STAGE_PREFIX) and span["name"].endswith(ATTEMPT_SUFFIX)


def _bar(span: dict[str, Any], t0: int, label: str, level: int, note: str = "") -> Bar:
    start = (span["start_time_unix_nano"] - t0) / 1e9
    end = (span["end_time_unix_nano"] - t0) / 1e9
    return Bar(printable(label), level, start, end, printable(_outcome(span)), printable(note))


MAX_OUTCOME = 24  # 'attempt_failed' and every outcome the stages write fit


def _outcome(span: dict[str, Any]) -> str:
    """The span's outcome; a damaged one (any JSON value) cut to ``MAX_OUTCOME`` characters, so it
    cannot widen the table until the span labels are cut."""
    outcome = span["attributes"].get("bootstrap.outcome")
    if outcome:
        text = str(outcome)
        return text if len(text) <= MAX_OUTCOME else text[: MAX_OUTCOME - 1] + "…"
    return "failed" if span["status"] == "ERROR" else "ok"


def _attempt_number(span: dict[str, Any]) -> str:
    number = span["attributes"].get("bootstrap.attempt")
    return str(number) if is_int(number) else "?"


def _stage_note(span: dict[str, Any]) -> str:
    attrs = span["attributes"]
    if attrs.get("bootstrap.skip_reason"):
        return f"skipped: {attrs['bootstrap.skip_reason']}"
    attempts = attrs.get("bootstrap.attempts", 1)
    return f"{attempts} attempts" if attempts != 1 else _error(span)


def _attempt_note(span: dict[str, Any]) -> str:
    changes = [
        f"{k.removeprefix('bootstrap.adapt.')}: {v}"
        for k, v in span["attributes"].items()
        if k.startswith("bootstrap.adapt.")
    ]
    return "; ".join([*changes, _error(span)] if _error(span) else changes)


def _error(span: dict[str, Any]) -> str:
    kind = span["attributes"].get("error.type")
    if not kind:
        return ""
    messages = [(e.get("attributes") or {}).get("exception.message") for e in span.get("events", [])]
    message = next((m for m in messages if m), "")
    return f"{kind}: {message}" if message else str(kind)
