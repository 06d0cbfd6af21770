"""``benchmarks/serve_load.py`` against a real ``bootstrap serve`` of a tiny random model on the CPU:
requests the server refuses are counted, named and make the script exit 1 (no timing is asserted)."""

from __future__ import annotations

import json

from helpers.bench_runs import failed_run

TINY = {
    **{"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64},
    **{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    **{"max_position_embeddings": 128, "torch_dtype": "float32"},
}


def test_refused_requests_are_counted_written_and_exit_1(tmp_path):
    """Prompt token ids drawn below 4096 for a model of 128: the server refuses them (HTTP 400)
    at every level. The JSON is written with each level's failures and their sum, stderr says so
    in one line naming the status, and the exit status is 1, without a traceback."""
    config, out = tmp_path / "tiny.json", tmp_path / "serve_load.json"
    config.write_text(json.dumps(TINY))
    argv = ["--model", f"random:{config}", "--device", "cpu", "--levels", "1,2", "--requests", "2"]
    argv += ["--prompt-len", "8", "--gen-len", "2", "--max-batch-size", "4", "--max-seq-len", "64", "--vocab", "4096"]
    reason, report = failed_run("serve_load", argv, out)
    assert reason.startswith("serve_load: 4 of 4 requests failed (HTTP 400 x4): prompt"), reason
    assert [(level["clients"], level["failed"]) for level in report["levels"]] == [(1, 2), (2, 2)]
    assert report["failures"]["failed"] == 4 and report["failures"]["statuses"] == {"400": 4}
    assert reason.endswith(report["failures"]["first_error"])
    assert all(level["output_tokens"] == 0 for level in report["levels"])
    assert report["server_exit_code_after_sigterm"] == 0
