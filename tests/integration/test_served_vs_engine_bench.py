"""``benchmarks/served_vs_engine.py --smoke`` as a user runs it: a real server (and, as the
baseline, one whose engine runs in the server's process: ``--engine-in-process``), its clients in
two processes, and a real in-process executor on a tiny random model, every token of every request
counted on each side and the ratios side by side; requests the server refuses are counted and the
script exits 1 (its clients in this process)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.bench_runs import BENCHMARKS, failed_run


def test_both_sides_stream_every_token_at_every_level(tmp_path):
    out = tmp_path / "sve.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "served_vs_engine.py"),
            "--smoke",
            "--baseline-serve-args=--engine-in-process",
            "--client-processes=2",  # the served sides' streams over two spawned processes (the GPU host's way)
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS.parent,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [level["streams"] for level in result["levels"]] == [1, 4]
    for level in result["levels"]:
        for side in ("served", "served_baseline", "in_process"):
            figures = level[side]
            assert figures["requests"] == 2 * level["streams"]  # two requests a stream
            assert figures["output_tokens"] == figures["requests"] * 8  # every token had its chunk or event
            assert figures["failures"]["failed"] == 0
            assert 0 < figures["ttft_ms_p50"] <= figures["ttft_ms_p99"]
            assert 0 < figures["itl_ms_p50"] <= figures["itl_ms_p99"]
        for side in ("served", "served_baseline"):
            # the server's CPU is read in clock ticks (10 ms): a smoke level can take less than one
            assert level[side]["client_cpu_cores"] > 0 and level[side]["server_cpu_us_per_token"] >= 0
            ratio = level[side]["output_tok_s"] / level["in_process"]["output_tok_s"]
            assert level[f"{side}_over_in_process"] == round(ratio, 3)
    assert result["failures"]["failed"] == 0


def test_requests_the_server_refuses_are_counted_and_exit_1(tmp_path):
    reason, result = failed_run(
        "served_vs_engine", ["--smoke", "--serve-args=--max-seq-len 12"], tmp_path / "sve.json"
    )  # 8 prompt tokens + 8 generated do not fit 12: every served request is refused
    assert result["failures"]["failed"] == sum(level["served"]["requests"] for level in result["levels"])
    assert all(level["in_process"]["failures"]["failed"] == 0 for level in result["levels"])
    assert "400" in reason
