"""What a newcomer meets first (issue 56, item 10): each command's ``--help`` lists only the exit
statuses that command can end with, ``bootstrap`` alone prints its usage, and no progress line
ends in a space. The real parser and commands, in process."""

from __future__ import annotations

import pytest

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.exits import BAD_INPUT, HUNG_UP, INTERRUPTED, OK, STAGE_FAILED, TERMINATED
from bootstrap.cli.main import COMMANDS, main

STATUSES = {
    "plan": [OK, STAGE_FAILED, BAD_INPUT, INTERRUPTED],
    "run": [OK, STAGE_FAILED, BAD_INPUT, INTERRUPTED, TERMINATED, HUNG_UP],
    "serve": [OK, STAGE_FAILED, BAD_INPUT],
    "trace": [OK, BAD_INPUT, INTERRUPTED],
    "cache": [OK, STAGE_FAILED, BAD_INPUT, INTERRUPTED],
}


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_s_help_lists_its_own_exit_statuses(command, capsys):
    out = help_text(capsys, command)
    table = out[out.index("\nexit status:\n") :].splitlines()[2:]
    assert [int(line.split()[0]) for line in table if line.startswith("  ") and line[2] != " "] == STATUSES[command]
    assert max(len(line) for line in out.splitlines()) <= 80


def test_serve_s_help_says_a_signal_is_its_normal_end(capsys):
    out = help_text(capsys, "serve")
    assert "  0    stopped by SIGTERM, SIGINT or SIGHUP, its normal end" in out and "143" not in out


def test_bootstrap_alone_prints_its_usage_and_commands(capsys):
    assert main([]) == BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: bootstrap ")
    for name in COMMANDS:
        assert f"\n    {name} " in err, name
    assert "\nexit status:\n" in err


def test_no_progress_line_ends_in_a_space(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    device = sim_device("h100-80gb")
    device.inject_oom("profiling", 1)  # a retry: every kind of line the progress has
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: SimBackend(device))
    main(["run", "--model", "llama-3.1-8b", "--no-plan-cache"])
    lines = capsys.readouterr().err.splitlines()
    assert "  profiling          done" in lines and "  warmup             skipped unsupported" in lines
    assert [line for line in lines if line != line.rstrip()] == []
