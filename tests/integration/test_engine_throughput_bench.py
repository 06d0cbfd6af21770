"""The throughput benchmark runs end to end on a tiny random model and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_throughput.py"
TINY = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}


def load_script():
    spec = importlib.util.spec_from_file_location("engine_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_reports_both_sides_for_every_batch_size(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "bench.json"
    argv = [
        "--model",
        f"random:{config}",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,3",
        "--prompt-len",
        "5",
        "--gen-len",
        "3",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    report = load_script().main(argv)
    assert json.loads(out.read_text()) == report
    assert [row["batch_size"] for row in report["results"]] == [1, 3]
    for row in report["results"]:
        for side in ("engine", "transformers"):
            assert row[side]["prefill_tok_s"] > 0 and row[side]["total_tok_s"] > 0
        assert set(row["engine_over_transformers"]) == {"prefill", "decode", "total"}
        # float32 on CPU: greedy output equals generate() token for token (near-ties aside, and
        # this seeded tiny model has none), so every request must match
        assert row["identical_outputs"] == f"{row['batch_size']}/{row['batch_size']}"
        roof = row["roofline"]
        assert roof["step_bytes"] == report["weight_bytes"] + roof["kv_bytes"]
        assert roof["roofline_tok_s"] == pytest.approx(
            row["batch_size"] * report["bandwidth_bytes_s"] / roof["step_bytes"], rel=1e-3
        )
        for side in ("engine", "transformers"):  # None only when timing noise hid the decode time
            assert row[side]["decode_roofline_fraction"] is None or row[side]["decode_roofline_fraction"] > 0
    assert report["cuda_graphs"] == "off (cpu)" and "engine_graphs" not in report["results"][0]


@pytest.mark.parametrize("bad", [["--batch-sizes", "0,8"], ["--gen-len", "1"], ["--prompt-len", "x"]])
def test_bad_flags_are_rejected(bad):
    with pytest.raises(SystemExit):
        load_script().parse_args(bad)
