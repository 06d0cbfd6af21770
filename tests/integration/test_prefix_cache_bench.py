"""``benchmarks/prefix_cache.py --preset tiny`` end to end on the CPU: two real servers (cache on,
then off), every request answered on both, the same greedy answers, the cache's hits counted on
the "on" server only (no timing is asserted). Everything it writes goes under ``tmp_path``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from helpers.bench_runs import failed_run

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tiny_preset_measures_both_servers_side_by_side(tmp_path, capsys):
    out, work = tmp_path / "prefix_cache.json", tmp_path / "work"
    sizes = ["--requests", "3", "--system-tokens", "64", "--question-tokens", "6", "--max-tokens", "3"]
    report = load_script("prefix_cache").main(["--preset", "tiny", *sizes, "--work-dir", str(work), "--out", str(out)])
    assert json.loads(out.read_text()) == report and "error" not in report
    assert {"date_utc", "torch", "device"} <= set(report["environment"])
    assert report["order"] == ["on", "off"] and set(report["arms"]) == {"on", "off"}
    on, off = report["arms"]["on"], report["arms"]["off"]
    assert "--no-prefix-cache" in off["command"] and "--no-prefix-cache" not in on["command"]
    assert "--served-model-name prefix-cache" in on["command"] and f"--plan-cache {work}" in on["command"]
    assert (on["plan_cached"], off["plan_cached"]) == (False, True)  # the second start found the first one's plan
    for arm in (on, off):
        assert arm["requests"] == arm["answered"] == 3 and arm["errors"] == []
        assert arm["exit_code_after_sigterm"] == 0
        assert arm["prompt_tokens"] == {"min": 70, "max": 70}  # 64 + 6 words, one token each
        assert arm["output_tokens"] == 9 and arm["ttft_ms_p50"] <= arm["ttft_ms_p99"] <= arm["e2e_ms_p99"]
        assert arm["warmup"]["error"] is None and arm["warmup"]["cached_tokens"] == 0
    assert report["outputs"] == {
        **{"compared": 3, "equal": True, "differing": 0, "same_first_chunk": 3, "agreeing_chunks_min": 3},
        "samples": [],
    }
    # the system prompt's two full blocks of 32 tokens, computed by the warm-up, then found by every request
    assert on["cached_tokens"] == [64, 64, 64] and off["cached_tokens"] == [0, 0, 0]
    assert on["metrics_delta"] == {"query_tokens": 210, "hit_tokens": 192} and on["hit_rate"] == round(192 / 210, 3)
    assert (
        on["metrics_after"]["bootstrap_prefix_caching"] == 1 and off["metrics_after"]["bootstrap_prefix_caching"] == 0
    )
    assert off["metrics_delta"] == {"query_tokens": 0, "hit_tokens": 0} and off["hit_rate"] is None
    ratios = report["ratios"]
    assert ratios["ttft_p50_off_over_on"] == round(off["ttft_ms_p50"] / on["ttft_ms_p50"], 3)
    assert ratios["throughput_on_over_off"] == round(on["output_tokens_per_s"] / off["output_tokens_per_s"], 3)
    assert "targets" not in report  # only the 8b preset states them
    assert "outputs equal: True (3/3)" in capsys.readouterr().out
    assert sorted(p.name for p in work.iterdir()) == []  # the checkpoint, caches and logs removed


def test_every_request_refused_is_counted_written_and_exits_1(tmp_path):
    """A checkpoint whose tokenizer has no chat template: the servers refuse every chat request
    (HTTP 400). The script still writes its JSON with the failures counted (the warm-ups too),
    names the status and the first error in one line on stderr, and exits 1, without a traceback."""
    from types import SimpleNamespace

    shape, model = tmp_path / "tiny.json", tmp_path / "no-template"
    shape.write_text(json.dumps(load_script("prefix_cache").TINY))
    load_script("cold_start").write_checkpoint(SimpleNamespace(shape=str(shape), device="cpu"), model, words=None)
    out = tmp_path / "prefix_cache.json"
    sizes = ["--requests", "2", "--system-tokens", "8", "--question-tokens", "2", "--max-tokens", "2"]
    argv = ["--preset", "tiny", "--model", str(model), "--words", "ids", *sizes]
    reason, report = failed_run("prefix_cache", [*argv, "--work-dir", str(tmp_path / "w")], out)
    assert "6 of 6 requests failed (HTTP 400 x6)" in reason and "no chat template" in reason, reason
    assert report["failures"]["requests"] == report["failures"]["failed"] == 6
    assert report["failures"]["statuses"] == {"400": 6} and "no chat template" in report["failures"]["first_error"]
    for arm in report["arms"].values():
        assert arm["answered"] == 0 and arm["failures"]["failed"] == 3 and arm["ttft_ms_p50"] is None
    assert report["outputs"]["differing"] == 2
