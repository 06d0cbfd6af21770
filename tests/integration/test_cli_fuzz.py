"""Generated values for every flag of every command (issue 20, reliability round 3): the outcome
is exit 0 or 2, an exit 2 says why in one line on stderr naming the field (never a traceback),
and invalid input never starts work: no stage, no model, no port, no rank.

The bulk drives ``bootstrap.cli.main.main(argv)`` in-process, with the work entry points
replaced by a recorder (``Started``): ``plan``'s tracer provider (the first thing its run
creates, before any stage), ``run``'s ``run_command`` and ``launch_ranks``, ``serve``'s
``_serve`` (where uvicorn binds the port), ``trace``'s ``write_png`` and ``cache``'s ``remove``.
A valid value may reach the recorder, which then checks that what would have started got the
value as parsed; an invalid one must not. stdout and stderr are UTF-8 streams as in a UTF-8
locale (stdout strict, stderr ``backslashreplace``), not capsys's, so text a real process
could not print fails here too. ``SUBPROCESS`` repeats a dozen examples in a real process and
compares exit status and message with the in-process result.

Examples (hypothesis, ``derandomize=True``: the seed is derived from each test's name, the
same on every run; no database): at most 12 per (command, flag) in ``test_one_flag`` (91 pairs;
984 run, switches and positionals run out sooner), at most 4 per pair in ``test_repeated_flag``
(322 run), 40 per command in ``test_flag_combinations`` (200): 1506 in all, about 40 s on 2 cores.
Argv forms: ``--flag value``, ``--flag=value``, a missing value, the flag twice. Values: ints
(huge, negative, 5000 digits, non-ASCII digits), floats (nan, inf, -0.0, 1e308, 1e309), text
(empty, whitespace, unicode, argv's surrogate escapes of non-UTF-8 bytes), paths (absent, a
FIFO, a directory, a file, /dev/null, a file's child).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.cli_fuzz import HARD, PATHS, TEXT, Cli, Outcome, actions, expand, is_switch, parse, valid, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bootstrap.cli.main import main

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
BASE = {  # a valid, cheap argv per command; {tmp}: the test's folder
    "plan": ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"],
    "run": ["run", "--device", "cpu"],
    "serve": ["serve"],
    "trace": ["trace", "{tmp}/good.jsonl"],
    "cache": ["cache", "list", "--plan-cache", "{tmp}/plans", "--model-cache", "{tmp}/models"],
}
POSITIONAL = {("trace", "files"), ("cache", "action")}
PAIRS = [(command, flag) for command in BASE for flag in actions(command)]


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A trace file of a real ``plan`` run (the simulated GPU), written once."""
    path = tmp_path_factory.mktemp("trace") / "good.jsonl"
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()
    try:
        assert main([*BASE["plan"], "--trace-file", str(path)]) == 0
    finally:
        sys.stdout, sys.stderr = saved
    return path.read_bytes()


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good_trace: bytes) -> Cli:
    """A folder holding a good trace file, another file, a directory and a FIFO; the recorder."""
    for folder in ("cwd", "plans", "models", "adir"):
        (tmp_path / folder).mkdir()
    (tmp_path / "afile").write_text("not a trace\n")
    (tmp_path / "good.jsonl").write_bytes(good_trace)
    os.mkfifo(tmp_path / "fifo")
    return Cli(tmp_path, monkeypatch)


# ---- the contract -----------------------------------------------------------------------------


def check_contract(outcome: Outcome, command: str) -> None:
    """Exit 0 or 2 (or the work reached), no traceback, and an exit 2 in one line: the
    command's own ``bootstrap: ...``, or argparse's ``bootstrap CMD: error: ... (see ... --help)``."""
    assert "Traceback" not in outcome.err, outcome.err
    if outcome.started is not None:
        return
    assert outcome.code in (0, 2), (outcome.code, outcome.err)
    if outcome.code == 2:
        assert len(outcome.lines) == 1, outcome.err
        if not is_argparse_refusal(outcome):
            assert outcome.lines[0].startswith("bootstrap: "), outcome.err


def is_argparse_refusal(outcome: Outcome) -> bool:
    """argparse's own refusal, one line (``bootstrap.cli.main.Parser``)."""
    return len(outcome.lines) == 1 and ": error: " in outcome.lines[0] and outcome.lines[0].endswith(" --help)")


def names_the_field(line: str, action: argparse.Action) -> bool:
    words = {action.dest, action.dest.replace("_", " ")} | {f.lstrip("-") for f in action.option_strings}
    return any(w.lower() in line.lower() for w in words) or "trace file" in line or "gpu" in line.lower()


def reached_value(outcome: Outcome, action: argparse.Action) -> Any:
    """The flag's value as the recorder saw it: the config's field, else the command's own flag."""
    seen = outcome.started.seen
    config = seen.get("config")
    if config is not None and action.dest in type(config).model_fields:
        return getattr(config, action.dest)
    (args,) = [a for a in seen["args"] if isinstance(a, argparse.Namespace)]
    return getattr(args, action.dest)


def expected_value(action: argparse.Action, parsed: Any) -> Any:
    return tuple(sorted(set(parsed))) if action.dest == "cuda_graph_batch_sizes" else parsed


def judge(outcome: Outcome, command: str, action: argparse.Action, parsed_ok: bool, parsed: Any) -> None:
    """The contract, then: a value argparse refuses is refused by argparse; a value the rules
    refuse never reaches the work and is refused naming its field; a value they accept does."""
    check_contract(outcome, command)
    if not parsed_ok:
        assert outcome.code == 2 and is_argparse_refusal(outcome), outcome.err
        return
    verdict = valid(command, action, parsed)
    if outcome.started is not None:
        assert verdict is not False, f"{action.dest}={parsed!r} reached {outcome.started.where}"
        if command in ("run", "serve") or action.dest in type(outcome.started.seen["config"]).model_fields:
            assert reached_value(outcome, action) == expected_value(action, parsed), outcome.started.seen
    elif verdict is False:
        assert outcome.code == 2 and names_the_field(outcome.lines[-1], action), outcome.err
    elif verdict is True:
        assert command in ("trace", "cache") and outcome.code == 0, (outcome.code, outcome.err)


# ---- one flag, every value --------------------------------------------------------------------


@pytest.mark.parametrize(("command", "flag"), PAIRS, ids=[f"{c} {f}" for c, f in PAIRS])
@settings(FUZZ, max_examples=12)
@given(data=st.data())
def test_one_flag(cli, command, flag, data):
    action = actions(command)[flag]
    base = expand(BASE[command], cli.tmp)
    if (command, flag) in POSITIONAL:
        return check_positional(cli, command, flag, action, data)
    if is_switch(action):
        value = data.draw(st.sampled_from([None, "x", ""]), label="value")
        outcome = cli([*base, flag] if value is None else [*base, f"{flag}={value}"])
        check_contract(outcome, command)
        if value is not None:  # a switch takes no value: argparse's refusal
            assert outcome.code == 2 and is_argparse_refusal(outcome), outcome.err
        else:
            assert outcome.started is not None or outcome.code == 0, outcome.err
        return
    value = expand([data.draw(values(command, flag, action), label="value")], cli.tmp)[0]
    form = data.draw(st.sampled_from(["space", "equals", "missing"]), label="form")
    argv = {"space": [*base, flag, value], "equals": [*base, f"{flag}={value}"], "missing": [*base, flag]}[form]
    outcome = cli(argv)
    if form == "missing":
        check_contract(outcome, command)
        assert outcome.code == 2 and is_argparse_refusal(outcome), outcome.err
        return
    takes, parsed = parse(action, value)
    if form == "equals" and value == "--":  # argparse (3.11) makes it []: refused by the command
        check_contract(outcome, command)
        assert (outcome.code, outcome.started) == (2, None) and names_the_field(outcome.lines[-1], action)
        return
    if form == "space" and value.startswith("-") and not re.fullmatch(r"-\d+$|-\d*\.\d+$", value):
        check_contract(outcome, command)  # argparse reads it as a flag: its refusal, or the value
        return
    judge(outcome, command, action, takes, [parsed] if action.dest == "fault" else parsed)


def check_positional(cli: Cli, command: str, flag: str, action: argparse.Action, data: st.DataObject) -> None:
    if command == "cache":
        value = data.draw(st.one_of(st.sampled_from(["list", "clear"]), TEXT), label="action")
        outcome = cli(expand(["cache", *BASE["cache"][2:], "--", value], cli.tmp))
        check_contract(outcome, command)
        assert (outcome.code == 0) == (value in ("list", "clear")), outcome.err
        return
    files = expand(data.draw(st.lists(PATHS, min_size=1, max_size=3), label="files"), cli.tmp)
    files = [f for f in files if not f.startswith("-")] or [str(cli.tmp / "good.jsonl")]
    outcome = cli(["trace", *files])
    check_contract(outcome, command)
    readable = all(Path(f).expanduser().resolve() == (cli.tmp / "good.jsonl").resolve() for f in files if f)
    assert (outcome.code == 0) == (readable and all(files)), (files, outcome.err)


# ---- repeated flags: the last one counts (every one for --fault) ------------------------------


@pytest.mark.parametrize(("command", "flag"), PAIRS, ids=[f"{c} {f}" for c, f in PAIRS])
@settings(FUZZ, max_examples=4)
@given(data=st.data())
def test_repeated_flag(cli, command, flag, data):
    action = actions(command)[flag]
    if (command, flag) in POSITIONAL or is_switch(action):
        outcome = cli([*expand(BASE[command], cli.tmp), *([flag, flag] if is_switch(action) else [])])
        return check_contract(outcome, command)
    first, last = (expand([data.draw(values(command, flag, action))], cli.tmp)[0] for _ in range(2))
    outcome = cli([*expand(BASE[command], cli.tmp), f"{flag}={first}", f"{flag}={last}"])
    takes = [parse(action, v) for v in (first, last)]
    if "--" in (first, last) and action.dest != "fault":  # argparse (3.11) makes it []: refused by the command
        return check_contract(outcome, command)
    if action.dest == "fault":
        return judge(outcome, command, action, all(t for t, _ in takes), [first, last])
    if not takes[0][0]:  # argparse refuses the first, whatever the last
        return judge(outcome, command, action, False, None)
    judge(outcome, command, action, *takes[1])


# ---- several flags at once --------------------------------------------------------------------


@pytest.mark.parametrize("command", list(BASE))
@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_flag_combinations(cli, command, data):
    """Two to five flags of one command: the contract, and a value that no other flag can make
    valid (outside its field's hard range) never reaches the work."""
    named = {f: a for f, a in actions(command).items() if (command, f) not in POSITIONAL}
    chosen = data.draw(
        st.lists(st.sampled_from(sorted(named)), min_size=min(2, len(named)), max_size=5, unique=True), label="flags"
    )
    argv, given_values = expand(BASE[command], cli.tmp), {}
    for flag in chosen:
        if is_switch(named[flag]):
            argv.append(flag)
            continue
        value = expand([data.draw(values(command, flag, named[flag]), label=flag)], cli.tmp)[0]
        argv.append(f"{flag}={value}")
        given_values[flag] = value
    outcome = cli(argv)
    check_contract(outcome, command)
    if outcome.started is None:
        return
    for flag, value in given_values.items():
        takes, parsed = parse(named[flag], value)
        verdict = (
            HARD.get(named[flag].dest, lambda v: None)([parsed] if flag == "--fault" else parsed) if takes else False
        )
        assert verdict is not False, f"{flag}={value!r} reached {outcome.started.where}"


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (BASE["plan"], "plan"),
        (BASE["run"], "stages"),
        (["run", "--tp", "3"], "ranks"),
        (BASE["serve"], "server"),
    ],
    ids=["plan", "run", "run-tp", "serve"],
)
def test_the_recorder_is_reached_by_valid_input(cli, argv, where):
    """The recorder stands where the work starts: without this, nothing above could fail."""
    outcome = cli(argv)
    assert outcome.started is not None and outcome.started.where == where, outcome.err


# ---- regressions (issue 20) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["run", "--prompt", "w4 \udcff"],
            "bootstrap: prompt: must be text UTF-8 can encode (a lone surrogate at character 3)",
        ),
        (
            ["run", "--chat", "\udcff\udcfe"],
            "bootstrap: chat: must be text UTF-8 can encode (a lone surrogate at character 0)",
        ),
        (
            ["serve", "--api-key", "k\udcff"],
            "bootstrap: api_key: must be text UTF-8 can encode (a lone surrogate at character 1)",
        ),
        (
            ["serve", "--served-model-name", "m\udcff"],
            "bootstrap: served_model_name: must be text UTF-8 can encode (a lone surrogate at character 1)",
        ),
    ],
    ids=["prompt", "chat", "api-key", "served-model-name"],
)
def test_text_utf8_cannot_encode_is_refused_before_any_work(cli, argv, line):
    outcome = cli(argv)
    assert (outcome.code, outcome.started, outcome.lines) == (2, None, [line]), outcome.err


def test_several_bad_fields_are_one_line_naming_each(cli):
    outcome = cli(
        [*BASE["plan"], "--max-batch-size", "0", "--tokens-per-block", "3", "--free-gpu-memory-fraction", "2"]
    )
    assert (outcome.code, outcome.started) == (2, None) and len(outcome.lines) == 1, outcome.err
    for field, allowed in (
        ("max_batch_size", "greater than or equal to 1"),
        ("tokens_per_block", "power of two"),
        ("free_gpu_memory_fraction", "less than or equal to 1"),
    ):
        assert field in outcome.lines[0] and allowed in outcome.lines[0], outcome.err


@pytest.mark.parametrize(
    "argv",
    [
        [*BASE["plan"], "--fault", "profiling:oom:²"],  # isdigit() takes it, int() does not
        [*BASE["plan"], "--fault", "profiling:oom:" + "9" * 5000],  # past int()'s 4300 digits
        [*BASE["plan"], "--trace-file", "{tmp}/fifo"],  # opening a FIFO to write blocks
        ["run", "--trace-file", "{tmp}/fifo"],
        ["trace", "{tmp}/fifo"],  # reading a FIFO blocks
        ["trace", "{tmp}/good.jsonl", "--png", "{tmp}/fifo"],
        ["run", "--device", "cuda:٣"],  # a non-ASCII digit: pydantic's \\d is Unicode
    ],
    ids=[
        "fault-superscript",
        "fault-5000-digits",
        "plan-trace-fifo",
        "run-trace-fifo",
        "trace-fifo",
        "png-fifo",
        "device-arabic-digit",
    ],
)
def test_refused_in_one_line_before_any_work(cli, argv):
    outcome = cli(expand(argv, cli.tmp))
    assert (outcome.code, outcome.started, len(outcome.lines)) == (2, None, 1), outcome.err
    assert outcome.lines[0].startswith("bootstrap: ") and "Traceback" not in outcome.err


def test_cache_list_prints_a_path_that_is_not_utf8(cli):
    """A directory named with a byte that is not UTF-8: listed (``\\xff``), not a traceback on stdout."""
    outcome = cli(["cache", "list", "--plan-cache", str(cli.tmp / "d\udcff"), "--model-cache", str(cli.tmp / "models")])
    assert outcome.code == 0 and "d\\xff" in outcome.out, outcome.err


def test_argparse_refusal_is_one_line(cli):
    outcome = cli([*BASE["plan"], "--max-batch-size", "x"])
    assert outcome.code == 2 and outcome.lines == [
        "bootstrap plan: error: argument --max-batch-size: invalid int value: 'x' (see bootstrap plan --help)"
    ]


def test_run_tp_refusal_is_one_line(cli):
    outcome = cli(["run", "--tp", "2"])
    assert (outcome.code, outcome.started) == (2, None) and len(outcome.lines) == 1, outcome.err


def test_serve_refuses_a_malformed_backend_factory_before_the_port(cli):
    outcome = cli(["serve", "--backend-factory", "no-colon"])
    assert (outcome.code, outcome.started) == (2, None), outcome.err


# ---- the same in a real process ---------------------------------------------------------------

SUBPROCESS = [  # argv as bytes where the value is not UTF-8, as a shell passes it
    ["run", b"--prompt", b"w4 \xff"],
    ["run", "--chat", b"\xff\xfe"],
    ["serve", "--api-key", b"k\xff"],
    ["serve", "--served-model-name", b"m\xff"],
    [*BASE["plan"], "--max-batch-size", "0", "--tokens-per-block", "3"],
    [*BASE["plan"], "--fault", "profiling:oom:²"],
    [*BASE["plan"], "--trace-file", "{tmp}/fifo"],
    ["trace", "{tmp}/fifo"],
    ["trace", "{tmp}/good.jsonl", "--png", "{tmp}/fifo"],
    ["run", "--device", "cuda:٣"],
    ["run", "--temperature", "nan", "--seed", "-1"],
    ["serve", "--port", "70000"],
    ["cache", "list", "--plan-cache", "{tmp}/afile"],
]


def _text_argv(argv: list[Any], tmp: Path) -> list[str]:
    return expand([a.decode("utf-8", "surrogateescape") if isinstance(a, bytes) else a for a in argv], tmp)


@pytest.mark.parametrize("argv", SUBPROCESS, ids=[" ".join(_text_argv(a, Path("T"))) for a in SUBPROCESS])
def test_a_real_process_agrees(cli, argv):
    """Exit status and stderr of the console script equal the in-process result."""
    inside = cli(_text_argv(argv, cli.tmp))
    real_argv = [a if isinstance(a, bytes) else a.replace("{tmp}", str(cli.tmp)) for a in argv]
    env = {**os.environ, "HOME": str(cli.tmp), "PYTHONIOENCODING": "utf-8:strict"}
    env.pop("BOOTSTRAP_API_KEY", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bootstrap.cli", *real_argv],
            capture_output=True,
            timeout=30,
            env=env,
            cwd=cli.tmp / "cwd",
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv}: still running after 30 s")
    err = done.stderr.decode("utf-8", "replace")
    assert (done.returncode, inside.code) == (2, 2), (err, inside.err)
    assert [line for line in err.splitlines() if line.strip()] == inside.lines
