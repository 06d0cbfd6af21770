"""``bootstrap plan`` end to end on the simulated GPU: JSON shape, trace file, faults, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bootstrap.cli.main import main
from bootstrap.cli.plan import parse_fault
from bootstrap.stages import STAGE_IDS

ROOT = Path(__file__).resolve().parents[2]  # run the CLI of this checkout, whatever is installed


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_plan_for_llama_on_h100(capsys):
    code, out, err = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert [s["id"] for s in result["stages"]] == list(STAGE_IDS)
    outcomes = {s["id"]: s["outcome"] for s in result["stages"]}
    assert outcomes == {sid: "skipped" if sid == "warmup" else "ok" for sid in STAGE_IDS}  # no graphs simulated
    assert all(s["attempts"] == (0 if s["id"] == "warmup" else 1) for s in result["stages"])
    assert all(set(s) >= {"id", "outcome", "attempts", "duration_s"} for s in result["stages"])
    plan = result["plan"]
    assert plan["kv_budget_bytes"] > 40 * 1024**3  # ~64 GiB left after 15 GiB of weights
    assert plan["kv_tokens"] == plan["kv_budget_bytes"] // 131072 // 32 * 32
    assert plan["max_concurrent_requests"] == plan["kv_requests"] == plan["kv_tokens"] // plan["max_seq_len"]
    assert result["device"]["leaked_bytes"] == 0


def test_profiling_fault_retries_and_traces(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    code, _, err = run_cli(
        capsys,
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100-80gb",
        "--json",
        "--fault",
        "profiling:oom:1",
        "--trace-file",
        str(trace),
    )
    assert code == 0, err
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    names = [s["name"] for s in spans]
    assert names.count("bootstrap.pipeline") == 1
    assert sorted(n for n in names if n.startswith("bootstrap.stage.") and not n.endswith(".attempt")) == sorted(
        f"bootstrap.stage.{s}" for s in STAGE_IDS
    )
    attempts = [s for s in spans if s["name"] == "bootstrap.stage.profiling.attempt"]
    assert [a["status"] for a in attempts] == ["ERROR", "OK"]
    assert [a["attributes"]["bootstrap.attempt"] for a in attempts] == [1, 2]
    root = next(s for s in spans if s["name"] == "bootstrap.pipeline")
    assert root["parent_span_id"] is None
    by_id = {s["span_id"]: s for s in spans}
    assert all(by_id[a["parent_span_id"]]["name"] == "bootstrap.stage.profiling" for a in attempts)
    assert {s["trace_id"] for s in spans} == {root["trace_id"]}
    assert all(set(s) >= {"start_time_unix_nano", "end_time_unix_nano", "attributes", "events"} for s in spans)


def test_final_build_fault_exhausted_is_a_clear_error(capsys):
    code, out, err = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--fault", "final_build:oom:99")
    assert code == 1
    assert "final_build" in err and "3 attempts" in err and "out of memory" in err
    assert "free_gpu_memory_fraction" in err  # the stage's advice names the knob
    assert "Traceback" not in err + out
    assert "leaked bytes after teardown: 0" in out


def test_bad_input_exits_2_naming_the_field(capsys):
    code, _, err = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-batch-size", "0")
    assert code == 2 and "max_batch_size" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "--model", "no-such-model", "--gpu", "h100-80gb")
    assert code == 2 and "llama-3.1-8b" in err  # lists the presets
    code, _, err = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "tpu-v9")
    assert code == 2 and "h100-80gb" in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("capacity:oom", "allocates no device memory"),
        ("nope:oom", "is not a stage"),
        ("profiling:boom", "expected STAGE:oom"),
        ("profiling:oom:0", "N must be"),
    ],
)
def test_fault_spec_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_fault(text)
    assert parse_fault("profiling:oom:2") == ("profiling", 2)


def test_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "bootstrap.cli", "plan", "--model", "mixtral-8x7b", "--gpu", "h200"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "KV budget" in result.stdout and "profiling" in result.stdout


@pytest.mark.parametrize(
    "flag, below, expected",
    [
        ("--trace-file", "x", "trace_file: cannot write to {blocker}: {blocker} is not a directory"),
        ("--trace-file", "x/t.jsonl", "trace_file: cannot write to {blocker}/x: {blocker} is not a directory"),
        ("--plan-cache", "", "plan_cache: cannot write to {blocker}: {blocker} is not a directory"),
        ("--plan-cache", "x", "plan_cache: cannot write to {blocker}/x: {blocker} is not a directory"),
    ],
)
def test_a_file_in_the_way_of_an_output_directory_is_an_input_error(capsys, tmp_path, flag, below, expected):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / below if below else blocker
    code, out, err = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", flag, str(path), "--json")
    message = expected.format(blocker=blocker)
    assert code == 2 and "Traceback" not in err
    assert json.loads(out) == {"stages": [], "plan": {}, "device": None, "error": message}
    assert err == f"bootstrap: {message}\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file whose writes fail")
def test_a_trace_file_on_a_full_disk_costs_one_stderr_line_not_the_run():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "plan",
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "h100-80gb",
            "--trace-file",
            "/dev/full",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0 and "KV budget" in result.stdout
    assert result.stderr.splitlines() == [
        "could not export spans to trace file /dev/full (No space left on device); "
        "the rest of this run's spans are not sent there"
    ]


def test_json_plan_reports_what_final_build_allocated_after_a_shrink(capsys):
    code, out, _ = run_cli(
        capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--fault", "final_build:oom:1", "--json"
    )
    plan = json.loads(out)["plan"]
    assert code == 0
    assert plan["kv_budget_bytes"] == int(plan["planned_kv_budget_bytes"] * 0.9)
    assert plan["pools"]["target"]["gpu_bytes"] == plan["kv_budget_bytes"]
    assert plan["kv_tokens"] == plan["pools"]["target"]["tokens"] < plan["planned_kv_budget_bytes"] // 131072


def test_trace_file_is_overwritten_by_each_run(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    for _ in range(2):
        run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--trace-file", str(trace))
    names = [json.loads(line)["name"] for line in trace.read_text().splitlines()]
    assert names.count("bootstrap.pipeline") == 1


def test_sliding_window_state_beyond_memory_is_an_input_error(capsys):
    code, _, err = run_cli(
        capsys,
        "--model",
        "gemma-2-9b",
        "--gpu",
        "h200",
        "--max-batch-size",
        "256",
        "--max-seq-len",
        "8192",
        "--max-num-tokens",
        "8192",
    )
    assert code == 2 and "estimation_build" in err and "lower max_batch_size" in err


# The README's worked example, every figure of its derivation table (bytes).
WORKED_EXAMPLE = {
    "plan": {
        "kv_budget_bytes": 61_199_703_244,
        "kv_tokens": 466_912,
        "kv_blocks": 14_591,
        "kv_requests": 3,
        "max_concurrent_requests": 3,
        "max_seq_len": 131_072,
        "total_bytes": 85_027_979_264,
        "peak_bytes": 34_342_395_904,
    },
    "profile": {
        "total_bytes": 85_027_979_264,
        "model_bytes": 16_060_522_496 + 66_191_360,
        "probe_kv_bytes": 17_314_086_912,
        "activation_bytes": 277_889_024,
        "torch_peak_bytes": 33_718_689_792,
        "peak_bytes": 34_342_395_904,
    },
}


def test_the_worked_example_of_docs_memory_holds(capsys):
    code, out, err = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert {k: plan[k] for k in WORKED_EXAMPLE["plan"]} == WORKED_EXAMPLE["plan"]
    assert {k: plan["profile"][k] for k in WORKED_EXAMPLE["profile"]} == WORKED_EXAMPLE["profile"]
    non_torch = plan["profile"]["used_bytes"] - plan["profile"]["torch_used_bytes"]
    assert non_torch == 623_706_112
    example = (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")
    for figure in [*WORKED_EXAMPLE["plan"].values(), *WORKED_EXAMPLE["profile"].values(), non_torch, 66_191_360]:
        assert f"{figure:,}" in example, f"{figure:,} is no longer in docs/memory.md's worked example"


def test_the_worked_example_at_max_seq_len_8192(capsys):
    code, out, _ = run_cli(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-seq-len", "8192", "--json")
    plan = json.loads(out)["plan"]
    assert code == 0 and f"{plan['kv_budget_bytes'] / 1024**3:.2f}" == "57.00"
    assert (plan["kv_requests"], plan["max_concurrent_requests"]) == (56, 32)
