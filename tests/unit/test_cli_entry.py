"""``bootstrap.cli.entry``'s glance at the command line: the engine's process is started early
only for ``serve`` on one process with the engine in its own, with the flags it will keep."""

from __future__ import annotations

import pytest

from bootstrap.cli.entry import early_engine_flags


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["serve", "--model", "m"], ("info", False)),
        (["serve", "--device", "cuda", "--log-level", "debug"], ("debug", True)),
        (["serve", "--device=cuda:1", "--tp=1"], ("info", True)),
        (["serve", "--device", "cuda", "--backend-factory", "mod:make"], ("info", False)),  # no Triton ahead
        (["serve", "--tp", "2"], None),
        (["serve", "--tp=4", "--device", "cuda"], None),
        (["serve", "--engine-in-process"], None),
        (["serve", "--help"], None),
        (["serve", "-h"], None),
        (["serve", "--tp"], None),  # no value: the parser refuses it, and nothing was started
        (["serve", "--tp", "two"], None),
        (["run", "--model", "m"], None),
        (["plan"], None),
        ([], None),
    ],
)
def test_the_glance(argv, flags, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert early_engine_flags(argv) == flags


def test_a_rank_under_a_launcher_starts_none(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert early_engine_flags(["serve", "--model", "m"]) is None


def test_the_glance_says_nothing(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert early_engine_flags(["serve", "--tp"]) is None
    assert capsys.readouterr() == ("", "")
