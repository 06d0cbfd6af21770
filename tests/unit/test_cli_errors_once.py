"""A failed stage's error reaches the terminal once, whole, at 80 columns (issue 56, item 8): the
progress says ``failed`` and the paragraph at the end holds the error; an attempt that failed
and was retried is shown whole on one line with its retry. ``bootstrap run`` in process."""

from __future__ import annotations

import pytest

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.exits import BAD_INPUT, STAGE_FAILED
from bootstrap.cli.main import main

NOT_LOADABLE_END = "'random:<path to config.json>', or 'smollm2-135m-instruct'"


def test_a_model_that_cannot_be_loaded_is_one_paragraph_not_cut(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    code = main(["run", "--device", "cpu", "--model", "/nope", "--no-plan-cache"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT, err
    assert err.count("is not loadable") == 1, err
    lines = err.splitlines()
    assert "  resolve_classes    failed" in lines
    paragraph = [line for line in lines if line.startswith("bootstrap: failed at stage 'resolve_classes'")]
    assert len(paragraph) == 1 and paragraph[0].endswith(NOT_LOADABLE_END), err


@pytest.mark.parametrize("faults", [1, 9], ids=["retried", "out-of-retries"])
def test_each_attempt_error_is_shown_once_whole(faults, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    device = sim_device("h100-80gb")
    device.inject_oom("profiling", faults)
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: SimBackend(device))
    code = main(["run", "--model", "llama-3.1-8b", "--no-plan-cache"])
    err = capsys.readouterr().err
    attempts = [line for line in err.splitlines() if line.startswith("  profiling          attempt failed ")]
    retries = [line for line in err.splitlines() if line.startswith("  profiling          retrying ")]
    assert len(attempts) == len(retries) == min(faults, 2), err  # the third attempt's error is the paragraph
    assert attempts[0].endswith("(the dummy forward for max_num_tokens=2048 with a probe of 132,096 tokens)")
    assert retries[0] == "  profiling          retrying probe_tokens: 132096 -> 2080"
    if faults > 2:
        assert code == STAGE_FAILED and "  profiling          failed" in err.splitlines()
        assert err.count("with a probe of 1,056 tokens") == 1, err
