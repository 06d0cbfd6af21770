"""A retry a user can see (issue 56, item 3): ``bootstrap plan --fault profiling:oom:1`` and a
``run`` whose profiling runs out of memory once print, under the stage table, the failed
attempt's error and what the retry changed, whole, wrapped between words at the terminal's
width (``COLUMNS`` 80 and 200); ``--json`` carries them in the stage's ``retries``."""

from __future__ import annotations

import json

import pytest

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.exits import OK
from bootstrap.cli.main import main

PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--fault", "profiling:oom:1"]
ERROR = (
    "ProbeOutOfMemory: out of memory (injected fault) allocating 0.26 GiB for 'profiling/activations' on h200 "
    "(the dummy forward for max_num_tokens=2048 with a probe of 132,096 tokens)"
)
CHANGE = "retried with probe_tokens: 132096 -> 2080"


def retry_block(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  profiling attempt 1 failed: "))
    end = next(i for i, line in enumerate(lines) if line.strip() == CHANGE)
    return lines[start : end + 1]


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_shows_the_retry_s_error_and_change_within_the_width(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(PLAN) == OK
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    block = retry_block(out)
    assert " ".join(" ".join(block).split()) == f"profiling attempt 1 failed: {ERROR} {CHANGE}"  # every word whole
    assert all(line == line.rstrip() for line in block)
    assert block[-1] == f"    {CHANGE}" and len(block) == {80: 4, 200: 3}[columns]


def test_plan_json_carries_each_retry(capsys):
    assert main([*PLAN, "--json"]) == OK
    stages = {row["id"]: row for row in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["profiling"]["retries"] == [{"attempt": 1, "error": ERROR, "change": "probe_tokens: 132096 -> 2080"}]
    assert stages["load_model"]["retries"] == []


def test_run_shows_the_retry_under_its_stage_table(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    device = sim_device("h200")
    device.inject_oom("profiling", 1)
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: SimBackend(device))
    main(["run", "--model", "llama-3.1-8b", "--no-plan-cache"])  # the simulated executor takes no prompt: exit 2
    out = capsys.readouterr().out
    block = retry_block(out)
    assert " ".join(" ".join(block).split()) == f"profiling attempt 1 failed: {ERROR} {CHANGE}"
    assert max(len(line) for line in out.splitlines()) <= 80
