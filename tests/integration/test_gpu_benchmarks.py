"""The GPU benchmarks (startup, capacity) end to end on the CPU with a tiny random model: every
figure they report is there and consistent with the others (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bootstrap.cli.main import main as cli_main

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "torch_dtype": "float32",
}
SHAPE = ["--device", "cpu", "--max-seq-len", "64", "--max-num-tokens", "64", "--max-batch-size", "4"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    config = tmp_path_factory.mktemp("tiny") / "config.json"
    config.write_text(json.dumps(TINY))
    return f"random:{config}"


def test_startup_reports_cold_warm_and_floor_side_by_side(tiny, tmp_path, capsys):
    out, traces = tmp_path / "startup.json", tmp_path / "traces"
    report = load_script("startup").main(
        ["--models", tiny, *SHAPE, "--repeats", "2", "--trace-dir", str(traces), "--out", str(out)]
    )
    assert json.loads(out.read_text()) == report
    assert {"date_utc", "torch", "transformers", "device_name"} <= set(report["environment"])
    [model] = report["models"]  # on the CPU only the graphs-off setting of the default "off,on"
    assert model["shape"]["layers"] == 2 and len(model["rounds"]) == 2 and model["cuda_graphs"] is False
    cold, warm, floor, best = model["cold"], model["warm"], model["floor"], model["best"]
    assert {k: (s["outcome"], s["skip_reason"]) for k, s in cold["stages"].items() if s["outcome"] != "ok"} == {
        "warmup": ("skipped", "disabled")
    }
    assert {k: (s["outcome"], s["skip_reason"]) for k, s in warm["stages"].items() if s["outcome"] != "ok"} == {
        "estimation_build": ("skipped", "plan-cache"),
        "profiling": ("skipped", "plan-cache"),
        "warmup": ("skipped", "disabled"),
    }
    assert warm["plan"] == cold["plan"] and floor["pool_bytes"] == cold["plan"]["kv_budget_bytes"]
    assert floor["capture_s"] == 0
    assert floor["floor_s"] == pytest.approx(floor["weights_s"] + floor["forward_s"] + floor["pool_s"], abs=1e-3)
    assert best["cold_s"] == min(r["cold"]["ready_s"] for r in model["rounds"])
    assert model["ratios"]["cold_over_floor"] == round(best["cold_s"] / best["floor_s"], 3)
    assert model["ratios"]["warm_over_cold"] == round(best["warm_s"] / best["cold_s"], 3)
    capsys.readouterr()
    assert cli_main(["trace", cold["trace_file"], warm["trace_file"]]) == 0  # the traces render
    assert "skipped" in capsys.readouterr().out


def test_capacity_fills_every_block_and_counts_errors(tiny, tmp_path):
    out = tmp_path / "capacity.json"
    report = load_script("capacity").main(["--model", tiny, *SHAPE, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    trtllm_rule, default = report["starts"]
    assert trtllm_rule["config"]["free_gpu_memory_fraction"] == 0.9 and trtllm_rule["plan"]["headroom_bytes"] is None
    assert default["plan"]["headroom_bytes"] is None  # the CPU has no default headroom: the fraction rule
    for start in (trtllm_rule, default):
        load = start["load"]
        assert load["kv_fill_fraction"] == 1.0  # the CPU pool holds max_batch_size full requests
        assert load["requests"] == 4 and load["completed"] == 4
        assert load["requests_errored"] == load["steps_failed"] == load["unfinished_at_deadline"] == 0
    assert set(report["summary"]) == {"trtllm_default", "vllm_default", "fraction_0.9", "default"}
    assert report["peers"]["trtllm_default"]["fraction_of_physical"] == 0.9


def test_staggered_requests_are_full_length_and_finish_together():
    capacity = load_script("capacity")
    lengths = capacity.staggered_lengths(110, 8192, 8192)
    assert all(p + o == 8192 and p >= 1 and o >= 1 for p, o in lengths)
    done_prefill, finished = capacity.simulate([p for p, _ in lengths], [o for _, o in lengths], 8192)
    assert set(finished) == {max(done_prefill) + capacity.TAIL_STEPS - 1}


def test_a_start_that_fails_is_recorded_and_the_report_still_written(tiny, tmp_path):
    out = tmp_path / "capacity.json"
    report = load_script("capacity").main(["--model", tiny, *SHAPE, "--headroom-bytes", str(10**15), "--out", str(out)])
    trtllm_rule, default, headroom = report["starts"]
    assert "error" not in trtllm_rule and "error" not in default and "kv_headroom_bytes" in headroom["error"]
    assert report["summary"]["headroom"] == {"error": headroom["error"]} and json.loads(out.read_text()) == report


def run_smoke(out: Path, *flags: str):
    """``gpu_suite.sh --smoke FLAGS`` with its results under ``out``. No step has a wall-clock cap
    in the smoke but a hang guard (SMOKE_CAP_S), so a loaded machine does not fail it; the
    timeout here is a guard against a hang too."""
    import os
    import subprocess

    return subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_suite.sh"), "--smoke", *flags],
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=BENCHMARKS.parent,
    )


def no_failures(result: dict) -> None:
    """A benchmark's requests (or starts, or runs) all succeeded, and there were some."""
    failures = result["failures"]
    assert failures["failed"] == 0 and failures["requests"] > 0 and failures["statuses"] == {}, failures


def test_the_gpu_suite_script_runs_every_step_and_writes_every_result(tmp_path):
    """``gpu_suite.sh --smoke``: the same steps on the CPU with tiny shapes (tests/gpu skip)."""
    proc = run_smoke(tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = tmp_path / "out"
    expected = {
        "suite.log",
        "steps.jsonl",
        "startup.json",
        "capacity.json",
        "startup_8b_cold_warm.png",
        "traces.tar.gz",
        "cold_start.json",
    }
    assert {p.name for p in out.iterdir()} == expected  # the device tool brings back at most 8 files
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [
        "install_wheels",
        "environment",
        "startup",
        "capacity",
        "timeline_png",
        "cold_start",
    ]
    assert all(s["rc"] == 0 for s in steps)
    assert "capacity: finished, exit 0" in (out / "suite.log").read_text()
    cold_start = json.loads((out / "cold_start.json").read_text())
    no_failures(cold_start)
    assert cold_start["checkpoint"]["checkpoint"].endswith("/checkpoint-tiny")
    for mode in ("cold", "warm"):  # the engine's own process, found under the server's
        serve = cold_start["repeats"][0][mode]["serve"]
        assert serve["engine_started_s"] >= 0
        assert serve["spans"]["engine.imports"] > 0 and serve["spans"]["engine.backend"] >= 0  # its own phases
        assert serve["weights"]["target.read_bytes"] > 0 and serve["weights"]["target.compile_wait_s"] >= 0
    floor = cold_start["floor"]
    assert floor["floor_s"] > floor["import_torch_s"] > 0 and floor["fastest_weights"] in floor["weights"], floor


def test_the_gpu_suite_s_tests_run_in_an_invocation_of_their_own(tmp_path):
    """``gpu_suite.sh --smoke --tests``: tests/gpu alone (each skips without CUDA), its JUnit report."""
    out = tmp_path / "out"
    proc = run_smoke(out, "--tests")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert {p.name for p in out.iterdir()} == {"suite.log", "steps.jsonl", "gpu_tests.xml"}
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [("install_wheels", 0), ("environment", 0), ("gpu_tests", 0)]
    report = (out / "gpu_tests.xml").read_text()
    assert 'tests="0"' not in report and "test_start_imports_cuda" in report


def test_the_gpu_suite_s_two_gpu_steps_run_on_the_cpu_and_write_every_result(tmp_path):
    """``gpu_suite.sh --smoke --tp2``: the NCCL issue's steps over gloo with a tiny shape (its
    GPU tests skip): a fresh start at --tp 2 (--tp 1's is the default smoke's ``cold_start``),
    greedy agreement of 1 and 2, the all-reduces of a decode step, the load side by side: every
    request answered, every step exit 0."""
    out = tmp_path / "out"
    proc = run_smoke(out, "--tp2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    written = {p.name for p in out.iterdir()}
    assert written == {"suite.log", "steps.jsonl", "tp2_tests.xml", "cold_start_tp2.json",
                       "tp_agreement.json", "tp_profile.json", "serve_load_tp.json"}  # fmt: skip
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    names = ["install_wheels", "environment", "tp2_tests", "cold_start_tp2", "tp_agreement"]
    assert [(s["step"], s["rc"]) for s in steps] == [(name, 0) for name in [*names, "tp_profile", "serve_load_tp"]]
    cold_start = json.loads((out / "cold_start_tp2.json").read_text())
    no_failures(cold_start)
    assert cold_start["checkpoint"]["checkpoint"].endswith("/checkpoint-tiny")  # TP_MODEL's
    tp2 = json.loads((out / "cold_start_tp2.json").read_text())["repeats"][0]["cold"]["serve"]
    assert tp2["code"] == 0 and tp2["first_token_s"] > tp2["ready_s"] > 0
    assert tp2["engine_started_s"] is None  # --tp N: each rank runs its engine
    agreement = json.loads((out / "tp_agreement.json").read_text())
    no_failures(agreement)
    assert agreement["runs"][1]["against_first"]["first_difference_at"] is None  # float32 on the CPU: the same tokens
    load = json.loads((out / "serve_load_tp.json").read_text())
    no_failures(load)
    assert load["server_exit_code_after_sigterm"] == [0, 0]
    assert [(level["tp"], level["clients"], level["failed"]) for level in load["levels"]] == [
        (1, 1, 0), (2, 1, 0), (1, 4, 0), (2, 4, 0)
    ]  # fmt: skip
    assert all(level["output_tokens"] > 0 for level in load["levels"]), load["levels"]
    one, two = json.loads((out / "tp_profile.json").read_text())["runs"]
    for run in (one, two):
        assert [rank["rank"] for rank in run["ranks"]] == list(range(run["tp"]))
        for rank in run["ranks"]:  # one all-reduce a row-parallel projection (the tiny llama: 2 a layer)
            assert rank["row_parallel_projections"] == (4 if run["tp"] == 2 else 0)
            assert [r["all_reduces_per_step"] for r in rank["results"]] == [rank["row_parallel_projections"]] * 2
            assert all((r["all_reduce_ms"] > 0) == (run["tp"] == 2) for r in rank["results"])


def test_an_oom_in_a_step_is_counted_even_when_the_reruns_succeed(tiny, monkeypatch):
    """One forward of the load runs out of memory (torch's own exception class, raised once); the
    executor reruns that step's requests one by one, they all finish, and the count says so."""
    import anyio
    import torch

    from bootstrap.api import Bootstrap
    from bootstrap.config import BootstrapConfig
    from bootstrap.engine.step.model_runner import ModelRunner

    capacity = load_script("capacity")
    real_run, calls = ModelRunner.run, []

    def third_step_runs_out(self, batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real_run(self, batch)

    async def load() -> dict:
        boot = Bootstrap(BootstrapConfig(model=tiny, device="cpu", max_seq_len=64, max_num_tokens=64, max_batch_size=4))
        try:
            executor = await boot.build()
            monkeypatch.setattr(ModelRunner, "run", third_step_runs_out)
            report = capacity.worst_case_load(executor, boot.report().plan, torch.device("cpu"), 120)
            assert "run" not in vars(executor.runner) and "sample" not in vars(executor.sampler)  # unwrapped
            return report
        finally:
            await boot.aclose()

    report = anyio.run(load)
    assert (report["steps_failed"], report["steps_failed_oom"]) == (1, 1) and calls[2] > 1
    assert report["completed"] == report["requests"] == 4 and report["requests_errored"] == 0
    assert "OutOfMemoryError: CUDA out of memory" in report["error_samples"][0]


def test_at_the_deadline_the_unfinished_requests_are_counted_and_cancelled(tiny):
    import anyio
    import torch

    from bootstrap.api import Bootstrap
    from bootstrap.config import BootstrapConfig

    capacity = load_script("capacity")

    async def load() -> tuple[dict, int]:
        boot = Bootstrap(BootstrapConfig(model=tiny, device="cpu", max_seq_len=64, max_num_tokens=64, max_batch_size=4))
        try:
            executor = await boot.build()
            report = capacity.worst_case_load(executor, boot.report().plan, torch.device("cpu"), 0.0)
            with anyio.move_on_after(30):  # the worker applies the cancellations in its next round
                while executor.scheduler.kv_cache.stats().used_blocks:  # noqa: ASYNC110 -- polls the worker's state
                    await anyio.sleep(0.05)
            return report, executor.scheduler.kv_cache.stats().used_blocks
        finally:
            await boot.aclose()

    report, used_blocks = anyio.run(load)
    assert report["unfinished_at_deadline"] >= 1 and report["completed"] + report["unfinished_at_deadline"] == 4
    assert used_blocks == 0  # the cancelled requests gave their blocks back


def test_live_ops_times_every_operation_against_its_floor_and_the_stress(tmp_path):
    """``live_ops.py`` on tiny checkpoints: every operation answered, with its stage rows and
    figures, floor and ratio; the plans cached where they should be; the stress counted."""
    out, work = tmp_path / "live_ops.json", tmp_path / "work"
    argv = ["--preset", "tiny", "--device", "cpu", "--cycles", "2", "--work-dir", str(work), "--out", str(out)]
    report = load_script("live_ops").main(argv)
    assert json.loads(out.read_text()) == report and "error" not in report
    assert not any(work.iterdir())  # without --keep, what it wrote is gone
    warm, start, ops = report["warmup_process"], report["start"], report["operations"]
    assert warm["idle"]["ready_s"] > 0 and warm["exit"]["code"] == 0
    assert not warm["swap_idle_to_a"]["plan_cached"] and not warm["swap_a_to_b"]["plan_cached"]
    assert start["plan_cached"] and start["first_token_s"] > start["ready_s"] > start["port_open_s"] > 0
    assert list(ops) == [
        "swap_a_to_b",
        "swap_b_to_a",
        "sleep_level_1",
        "wake_level_1",
        "sleep_level_2",
        "wake_level_2",
        "weights_a_to_a2",
    ]
    states = {name: (op["status"], op["state"]) for name, op in ops.items()}
    assert states == {name: (200, "asleep" if name.startswith("sleep") else "ready") for name in ops}
    for name, op in ops.items():
        assert op["server_duration_s"] <= op["post_s"], name
        if not name.startswith("sleep"):
            assert op["first_token_s"] > op["post_s"] and op["answer_status"] == 200, name
    assert ops["swap_a_to_b"]["plan_cached"] and ops["swap_b_to_a"]["plan_cached"]
    figures = {name: {row["id"]: row["figures"] for row in op["stages"]} for name, op in ops.items()}
    read = figures["weights_a_to_a2"]["read_weights"]["bootstrap.weights.read_bytes"]
    assert read == figures["weights_a_to_a2"]["check_weights"]["bootstrap.weights.bytes"] > 0
    assert figures["sleep_level_1"]["offload_weights"]["bootstrap.weights.host_bytes"] == read
    assert figures["wake_level_1"]["restore_weights"]["bootstrap.weights.restored_bytes"] == read
    assert "load_model" in figures["wake_level_2"] and "load_model" not in figures["wake_level_1"]
    assert ops["sleep_level_1"]["given_back"]["basis"] == "rss_bytes"  # the CPU: no device memory to read
    floors = report["floors"]
    assert floors["checks"] == dict.fromkeys(floors["checks"], True)  # float32 on the CPU: the same tokens
    for name, floor in floors["floor_s"].items():
        assert floor > 0 and floors["over_floor"][name] == round(ops[name]["first_token_s"] / floor, 3), name
    rates = floors["rates"]
    assert rates["loader"]["bytes"] >= read  # the loader counts the buffers (rotary frequencies) too
    assert rates["read_weights"]["gb_s"] > 0 < rates["host_to_device_copy_gb_s"]
    stress = report["stress"]
    assert stress["cycles_done"] == 2 and stress["swaps_failed"] == 0 and stress["answer_after_same_text"]
    assert all(row[k]["served_s"] for row in stress["cycles"] for k in ("to_a", "to_b"))
    assert stress["traffic"]["ok"] >= 4 and set(stress["traffic"]) <= {"ok", "http_503"}
    assert set(stress["growth"]) == {"rss_bytes", "threads", "fds", "process_mib"}
    tokens = "bootstrap_generation_tokens_total"
    assert stress["metrics_after"][tokens] > stress["metrics_before"][tokens]
    assert report["exit"] == {**report["exit"], "code": 0, "threads_left": []}
    # every request counted: 2 warm-up swaps and their answers, the first answer, 7 operations and the 5
    # answers after them, 2 swaps a cycle, the traffic, the answer after the stress; none failed
    requests = 4 + 1 + 12 + 2 * 2 + sum(stress["traffic"].values()) + 1
    assert report["failures"] == {"requests": requests, "failed": 0, "statuses": {}, "first_error": None}


def test_fp8_decode_times_the_added_decode_steps_of_each_side_against_the_first(tiny, tmp_path):
    """Two sides of the tiny model (a bfloat16 and an e4m3 KV cache): each batch's decode figure
    comes from the steps a G-token run adds to a G/2 one, marked whether every request was
    decoding through them, and the second side's figures are ratios of the first's."""
    args = ["--checkpoint", f"bf16={tiny},max_seq_len=64,max_num_tokens=16", "--checkpoint"]
    args += [f"fp8kv={tiny},max_seq_len=64,max_num_tokens=16,kv_cache_dtype=fp8", "--device", "cpu"]
    args += ["--batch-sizes", "1,4", "--prompt-len", "8", "--gen-len", "8", "--repeats", "1"]
    args += ["--prefill-batch", "2", "--prefill-len", "8", "--bandwidth-bytes", "4096", "--agreement-tokens", "16"]
    report = load_script("fp8_decode").main([*args, "--out", str(tmp_path / "fp8.json")])
    assert json.loads((tmp_path / "fp8.json").read_text()) == report
    reference, other = report["results"]["bf16"], report["results"]["fp8kv"]
    for side in (reference, other):
        one, four = side["batches"]["1"], side["batches"]["4"]
        assert (one["prefill_steps"], one["all_decoding"]) == (1, True)
        assert (four["prefill_steps"], four["all_decoding"]) == (2, True)  # 32 prompt tokens, 16 a step
        assert all(b["total_s"] > 0 and b["half_s"] > 0 and b["first_half_s"] > 0 for b in side["batches"].values())
    assert other["vs_bf16"]["kv_tokens"] == round(other["kv_tokens"] / reference["kv_tokens"], 3)
    assert other["vs_bf16"]["decode_tok_s"]["4"] == round(
        other["batches"]["4"]["decode_tok_s"] / reference["batches"]["4"]["decode_tok_s"], 3
    )
    with pytest.raises(SystemExit) as exited:
        load_script("fp8_decode").main([*args, "--gen-len", "1"])
    assert exited.value.code == 2


def test_prefill_chunk_attention_times_each_kv_dtype_over_new_shapes_and_again(tmp_path):
    """The engine's chunk-after-cache attention on the CPU, a float32 and an e4m3 pool: both passes
    over the same contexts, for each dtype, of the engine's way and of the two masked calls, which
    compute the same output; a chunk that leaves nothing cached is refused."""
    args = ["--device", "cpu", "--dtype", "float32", "--kv-dtypes", "float32,fp8", "--heads", "4"]
    args += ["--kv-heads", "2", "--head-dim", "16", "--chunk", "48", "--context", "100", "--shapes", "3"]
    report = load_script("prefill_chunk_attention").main([*args, "--out", str(tmp_path / "chunk.json")])
    assert json.loads((tmp_path / "chunk.json").read_text()) == report
    assert [r["kv_dtype"] for r in report["results"]] == ["float32", "fp8"]
    for result in report["results"]:
        assert result["contexts"] == [100, 137, 174]
        for way in ("", "masked_", "grouped_"):
            assert result[f"{way}first_pass_ms"] > 0 and result[f"{way}second_pass_ms"] > 0
        for way in ("masked_", "grouped_"):
            assert result[f"{way}max_abs_difference"] < 1e-4  # the same attention as the engine's
    with pytest.raises(SystemExit) as exited:
        load_script("prefill_chunk_attention").main([*args, "--chunk", "100"])
    assert exited.value.code == 2
