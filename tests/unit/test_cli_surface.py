"""The command line as a user meets it: every flag has help and shows its default, ``--help``
lists every command, one exit-status table holds for every command, ``--tp`` is checked before
any rank starts, and tables fit 80 columns."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
from rich.console import Console

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity.presets import preset_config, preset_names
from bootstrap.cli import run as run_command
from bootstrap.cli.args import HelpFormatter
from bootstrap.cli.exits import BAD_INPUT, INTERRUPTED, MEANINGS, OK, STAGE_FAILED
from bootstrap.cli.main import COMMANDS, build_parser, main
from bootstrap.pipeline.report import stage_table

PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    (group,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(group.choices)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_and_says_its_default(command):
    parser = subparsers()[command]
    formatter = HelpFormatter(command)
    for action in options(parser):
        text = formatter._get_help_string(action) or ""
        assert action.help, f"{command} {action.dest}: no help"
        if (
            action.option_strings
            and not action.required
            and not isinstance(action, argparse._StoreFalseAction | argparse._StoreTrueAction)
        ):
            assert "default" in text, f"{command} {action.option_strings[0]}: help does not say the default: {text!r}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_on_off_flag_shows_its_destination_s_value_as_its_default(command):
    """``--no-cuda-graphs`` stores False; its default, True, read as "on by default", says the opposite."""
    formatter = HelpFormatter(command)
    for action in options(subparsers()[command]):
        text = " ".join(formatter._expand_help(action).split())  # as --help prints it
        assert "(default: True)" not in text and "(default: False)" not in text, f"{action.option_strings}: {text}"


def test_model_help_lists_the_presets_and_names_the_default():
    run_help = subparsers()["run"].format_help()
    plan_help = subparsers()["plan"].format_help()
    for name in preset_names():
        assert name in " ".join(run_help.split()) and name in " ".join(plan_help.split())
    assert "(default: smollm2-135m-instruct)" in " ".join(run_help.split())


def test_help_lists_every_command_and_the_exit_table(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for name in COMMANDS:
        assert f"\n    {name} " in out, name
    for code in MEANINGS:
        assert f"\n  {code:<5}" in out
    assert max(len(line) for line in out.splitlines()) <= 80


# ---- one exit-status table for every command --------------------------------------------------


class Interrupt:
    """Stands for Ctrl-C reaching a command: what its work raises then."""

    def __call__(self, *args, **kwargs):
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    "argv, status",
    [
        (PLAN, OK),
        ([*PLAN, "--fault", "profiling:oom:3"], STAGE_FAILED),  # every retry of a stage ran out of memory
        (["plan", "--model", "llama-3.1-70b", "--gpu", "h200"], BAD_INPUT),  # the capacity stage: it cannot fit
        ([*PLAN, "--max-batch-size", "0"], BAD_INPUT),
        ([*PLAN, "--fault", "capacity:oom"], BAD_INPUT),
        (["plan", "--model", "llama-3.1-8b", "--gpu", "tpu-v9"], BAD_INPUT),
        (["run", "--max-tokens", "0"], BAD_INPUT),
        (["run", "--max-batch-size", "0"], BAD_INPUT),
        (["serve", "--port", "70000"], BAD_INPUT),
        (["serve", "--max-seq-len", "1"], BAD_INPUT),
        (["trace", "/no/such/trace.jsonl"], BAD_INPUT),
        (["cache", "clear", "--plan-cache", "{tmp}/plans", "--model-cache", "{tmp}/models"], OK),
        (["cache", "list", "--plan-cache", "{tmp}/plans", "--model-cache", "{tmp}/models"], OK),
        (
            ["cache", "list", "--model-cache", "{tmp}/plans", "--plans", "--models"],
            BAD_INPUT,
        ),  # one of the two, or both
        (["plan", "--no-such-flag"], BAD_INPUT),  # argparse's own refusal
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_exit_status(argv, status, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == status, err
    assert "Traceback" not in err
    if status != OK:
        assert err.strip(), "a failure says why on stderr"


def test_a_run_whose_stage_fails_at_run_time_exits_1(monkeypatch, capsys):
    """Out of memory in every profiling attempt of a real run's pipeline (the simulated GPU
    standing in for the device), reported as a stage failure."""
    device = sim_device("h100-80gb")
    device.inject_oom("profiling", 3)
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: SimBackend(device))
    code = main(["run", "--model", "llama-3.1-8b", "--json", "--no-plan-cache"])
    out, err = capsys.readouterr()
    assert code == STAGE_FAILED, err
    assert "bootstrap failed at stage 'profiling' after 3 attempts" in json.loads(out)["error"]


@pytest.mark.parametrize(
    "command, target",
    [
        ("plan", "bootstrap.cli.plan.anyio.run"),
        ("run", "bootstrap.cli.run.anyio.run"),
        ("trace", "bootstrap.cli.trace.command.read_spans"),
    ],
    ids=str,
)
def test_ctrl_c_exits_130(command, target, monkeypatch, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    argv = {"plan": PLAN, "run": ["run", "--no-plan-cache"], "trace": ["trace", str(trace)]}[command]
    monkeypatch.setattr(target, Interrupt())
    assert main(argv) == INTERRUPTED
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "serve"])
def test_without_torch_run_and_serve_name_the_install_command(command, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr("bootstrap.api.factory.find_spec", lambda name: None if name == "torch" else real(name))
    assert main([command, "--no-plan-cache"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert "pip install torch==2.13.0 && pip install -e '.[engine]'" in err and "Traceback" not in err


# ---- --tp before any rank ---------------------------------------------------------------------


def test_tp_that_does_not_divide_the_heads_exits_2_before_any_rank_starts(monkeypatch, tmp_path, capsys):
    config = {**preset_config("smollm2-135m"), "num_attention_heads": 9, "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    started = []
    monkeypatch.setattr(run_command, "launch_ranks", lambda *a: started.append(a) or 0)
    code = main(["run", "--device", "cpu", "--model", str(tmp_path), "--tp", "2", "--no-plan-cache"])
    err = capsys.readouterr().err
    assert (code, started) == (BAD_INPUT, [])
    assert "tensor_parallel_size: 2 does not divide the 9 attention heads" in err


def test_tp_that_does_not_divide_the_kv_heads_exits_2_before_any_rank_starts(monkeypatch, tmp_path, capsys):
    config = {**preset_config("smollm2-135m"), "num_attention_heads": 8, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(run_command, "launch_ranks", lambda *a: pytest.fail("a rank was started"))
    assert main(["run", "--device", "cpu", "--model", str(tmp_path), "--tp", "4", "--no-plan-cache"]) == BAD_INPUT
    assert "does not divide the 2 KV heads" in capsys.readouterr().err


def test_tp_over_a_source_ranks_cannot_load_exits_2_before_any_rank_starts(monkeypatch, capsys):
    monkeypatch.setattr(run_command, "launch_ranks", lambda *a: pytest.fail("a rank was started"))
    assert main(["run", "--device", "cpu", "--model", "random:llama-3.1-8b", "--tp", "2"]) == BAD_INPUT
    assert "needs a checkpoint directory" in capsys.readouterr().err


def test_serve_under_a_launcher_of_another_world_size_exits_2(monkeypatch, capsys):
    """``torchrun --nproc-per-node 3`` with ``--tp 2``: refused naming the field on every rank."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["serve", "--tp", "2", "--port", "0", "--no-plan-cache"]) == BAD_INPUT
    assert "tensor_parallel_size: 2, but the launcher started 3 ranks" in capsys.readouterr().err


# ---- 80 columns -------------------------------------------------------------------------------


def test_the_stage_table_fits_80_columns_uncut():
    rows = [
        {
            "id": stage,
            "outcome": outcome,
            "attempts": 3,
            "duration_s": 11.8214,
            "free_bytes_before": 141 * 2**30,
            "free_bytes_after": 2**30,
            "skip_reason": reason,
            "error": None,
        }
        for stage, outcome, reason in (
            ("scheduler_sampler", "ok", None),
            ("estimation_build", "skipped", "plan-cache"),
            ("warmup", "skipped", "unsupported"),
        )
    ]
    console = Console(width=80, record=True)
    console.print(stage_table(rows, title="ready in 13.25 s"))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text and "(plan-cache)" in text and "(unsupported)" in text and "11.82 s" in text
