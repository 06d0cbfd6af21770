"""``bootstrap trace`` on damaged files (issue 20, item 14): what can be read is shown, the rest
costs one warning per kind of damage on stderr, and no input ends in a traceback. Exit status 0
once something was shown; 2 with one line when nothing could be read or ``--png`` cannot be
written. The files start as a real ``bootstrap plan --trace-file`` trace (a retried profiling
stage), with a process span and a phase around it, then get cut or have a field replaced."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bootstrap.cli.main import main
from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.spans import STAGE_PREFIX

PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--fault", "profiling:oom:1", "--json"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(exclude_categories=())),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    ("name",),
    ("span_id",),
    ("parent_span_id",),
    ("start_time_unix_nano",),
    ("end_time_unix_nano",),
    ("status",),
    ("attributes",),
    ("events",),
    ("attributes", "bootstrap.outcome"),
    ("attributes", "bootstrap.attempt"),
    ("attributes", "bootstrap.attempts"),
    ("attributes", "bootstrap.skip_reason"),
    ("attributes", "error.type"),
    ("attributes", "bootstrap.adapt.probe_tokens"),
    ("events", 0),
    ("events", 0, "attributes"),
    ("events", 0, "attributes", "exception.message"),
]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> list[dict[str, Any]]:
    """The records of a valid trace: a plan run under a process span with one phase."""
    path = tmp_path_factory.mktemp("trace") / "plan.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*PLAN, "--trace-file", str(path)]) == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    root = next(r for r in records if r["name"] == "bootstrap.pipeline")
    start, end = min(r["start_time_unix_nano"] for r in records), root["end_time_unix_nano"]
    process = {
        **root,
        "name": "bootstrap.process",
        "span_id": "p" * 16,
        "parent_span_id": None,
        "attributes": {},
        "events": [],
        "start_time_unix_nano": start - 1000,
        "end_time_unix_nano": end + 1000,
    }
    phase = {
        **process,
        "name": "bootstrap.process.checks",
        "span_id": "c" * 16,
        "parent_span_id": "p" * 16,
        "end_time_unix_nano": start,
    }
    root["parent_span_id"] = "p" * 16
    return [phase, *records, process]


def encode(records: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def trace(data: bytes, *flags: str) -> tuple[int, str, str]:
    """``bootstrap trace`` on ``data``, on a wide UTF-8 terminal that takes nothing but UTF-8."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.jsonl"
        path.write_bytes(data)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["trace", str(path), *flags])
    out.flush()
    return code, out.buffer.getvalue().decode(), err.getvalue()


@pytest.fixture(scope="module", autouse=True)
def wide_terminal():
    """Rich reads COLUMNS: every label fits, so a stage shown is a stage found in the output."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "300"
    yield
    os.environ.pop("COLUMNS") if old is None else os.environ.update(COLUMNS=old)


def stages_of(records: list[Any], attempts: bool = False) -> list[str]:
    """The stage ids of the stage spans (and, with ``attempts``, of the attempt spans) among ``records``."""
    return [
        r["name"].removeprefix(STAGE_PREFIX).removesuffix(".attempt")
        for r in records
        if r["name"].startswith(STAGE_PREFIX) and (attempts or not r["name"].endswith(".attempt"))
    ]


def assert_clean(err: str) -> None:
    assert "Traceback" not in err
    assert all(line.startswith("bootstrap: ") for line in err.splitlines()), err


def test_a_file_cut_short_by_a_killed_writer_shows_every_complete_line(valid):
    data = encode(valid)
    code, out, err = trace(data[: len(data) - 30])  # the last line (the process span) loses its end
    assert code == 0, err
    assert all(stage in out for stage in stages_of(valid)) and "checks" in out
    assert err.splitlines() == [err.splitlines()[0]] and "cut short" in err and "skipped" in err
    assert_clean(err)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda r: {**r, "name": 7}, "name is not a string (got 7)"),
        (lambda r: {**r, "start_time_unix_nano": "12"}, "start_time_unix_nano is not nanoseconds"),
        (lambda r: {**r, "end_time_unix_nano": None}, "end_time_unix_nano is not nanoseconds"),
        (lambda r: {**r, "events": {"name": "exception"}}, "events is not a list of event objects"),
        (lambda r: {**r, "attributes": []}, "attributes is not an object"),
        (lambda r: [r], "not a span (a JSON list, not an object)"),
    ],
    ids=["name", "string time", "null time", "events", "attributes", "list"],
)
def test_each_damaged_field_costs_one_warning_with_its_count_and_the_rest_is_shown(valid, damage, words):
    damaged = [damage(r) if r["name"].endswith(".attempt") else r for r in valid]  # every attempt span
    code, out, err = trace(encode(damaged))
    assert code == 0, err
    assert all(stage in out for stage in stages_of(valid))
    attempts = sum(r["name"].endswith(".attempt") for r in valid)
    assert err.count("\n") == 1 and words in err and f"{attempts} lines (first: line 2)" in err, err
    assert_clean(err)


def test_bytes_that_are_not_utf8_and_lines_that_are_not_json_are_counted_and_skipped(valid):
    data = encode(valid[:5]) + b'{"name": "\xff\xfe"}\n' + b"{not json\n" * 2 + encode(valid[5:])
    code, out, err = trace(data)
    assert code == 0, err
    assert all(stage in out for stage in stages_of(valid))
    assert "line 6: not UTF-8 text" in err and "2 lines (first: line 7): not JSON" in err and err.count("\n") == 2
    assert_clean(err)


@pytest.mark.parametrize("data", [b"", b"\xff\xff\n", b"{cut", b'{"name": 1}\n[]\n'], ids=str)
def test_nothing_readable_is_exit_2_with_one_line(data):
    code, out, err = trace(data)
    assert code == 2 and err.count("\n") == 1 and "holds no bootstrap spans" in err and not out
    assert_clean(err)


@pytest.mark.parametrize("where", ["a file as its folder", "a folder"])
def test_a_png_path_that_cannot_be_written_is_exit_2_with_one_line_before_rendering(valid, tmp_path, where):
    (tmp_path / "file").write_text("")
    out_path = tmp_path / "file" / "t.png" if where == "a file as its folder" else tmp_path
    code, out, err = trace(encode(valid), "--png", str(out_path))
    assert code == 2 and err.count("\n") == 1 and f"png: cannot write {str(out_path)!r}" in err and not out
    assert_clean(err)


@SETTINGS
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_any_byte_cut_shows_every_complete_line_or_says_nothing_was_readable(valid, cut):
    data = encode(valid)
    data = data[: cut % (len(data) + 1)]
    complete = [json.loads(line) for line in data.split(b"\n") if parses(line)]  # a cut object is no JSON
    code, out, err = trace(data)
    assert_clean(err)
    if not stages_of(complete, attempts=True) and not any(r["name"] == "bootstrap.pipeline" for r in complete):
        assert code == 2 and err.count("\n") == 1
        return
    assert code == 0, err
    assert all(stage in out for stage in stages_of(complete, attempts=True))  # a stage cut off: its attempts


@SETTINGS
@given(data=st.data(), value=JSON_VALUES)
def test_any_json_value_in_any_field_never_fails_and_the_other_records_are_shown(valid, data, value):
    number = data.draw(st.integers(0, len(valid) - 1), label="line")
    path = data.draw(st.sampled_from(FIELDS), label="field")
    records = json.loads(json.dumps(valid))
    place(records[number], path, value)
    code, out, err = trace(encode(records))
    assert_clean(err)
    assert code == 0, err
    others = [r for i, r in enumerate(valid) if i != number]
    assert all(stage in out for stage in stages_of(others))


def parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def place(record: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Set ``record[path[0]][path[1]]...`` to ``value``, making the containers on the way."""
    target: Any = record
    for key in path[:-1]:
        if isinstance(key, int):
            if not target:
                target.append({})
            target = target[key]
        else:
            target = target.setdefault(key, [] if key == "events" else {})
    if isinstance(path[-1], int) and not target:
        target.append(value)
    else:
        target[path[-1]] = value


def test_read_spans_of_a_valid_file_is_unchanged(valid, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(encode(valid))
    assert read_spans(path) == valid


def test_a_stage_cut_off_during_its_retry_shows_its_failed_attempt(valid):
    """The writer stopped after profiling's first attempt failed: the attempt is what is left of the stage."""
    first_failed = next(i for i, r in enumerate(valid) if r["attributes"].get("error.type"))
    code, out, err = trace(encode(valid[: first_failed + 1]))
    assert code == 0 and not err, err
    row = next(line for line in out.splitlines() if "profiling" in line)
    assert "unfinished" in row and "ProbeOutOfMemory" in out


def test_text_no_terminal_can_take_is_shown_replaced(valid):
    """A JSON ``\\ud800`` escape decodes to a lone surrogate, which a UTF-8 terminal refuses."""
    records = [{**r, "name": r["name"] + "\ud800"} if r["name"].endswith("profiling") else r for r in valid]
    code, out, err = trace(encode(records))
    assert code == 0 and "profiling?" in out and not err


def test_with_several_files_one_unreadable_file_is_exit_2_with_its_line_only(valid, tmp_path, capsys):
    damaged, empty = tmp_path / "damaged.jsonl", tmp_path / "empty.jsonl"
    damaged.write_bytes(encode(valid)[:-30])
    empty.write_bytes(b"")
    assert main(["trace", str(damaged), str(empty)]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and f"trace file {str(empty)!r} holds no bootstrap spans" in err
