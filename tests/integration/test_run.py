"""``bootstrap run``: the stages build the real native executor on the CPU.

Checkpoints are tiny seeded models built in the tests (``tiny_models``); the CLI runs in
process (its entry point, ``main(argv)``), and once as a console script in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import save_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from bootstrap.capacity.presets import MODEL_PRESETS
from bootstrap.cli.main import main
from bootstrap.engine.step.model_runner import ModelRunner
from bootstrap.stages import STAGE_IDS

PROMPT = "w5 w17 w33 w9 w100 w42 w7"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: save_checkpoint(name, root / name) for name in ("llama", "qwen2", "mistral", "gemma2")}


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["run", "--device", "cpu", "--json", *argv])
    out = capsys.readouterr().out
    return code, json.loads(out)


def generate_reference(path: Path, prompt: str, max_tokens: int) -> list[int]:
    """transformers' own load, tokenizer and greedy ``generate()`` of the same checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
def test_greedy_run_equals_transformers_generate(arch, checkpoints, capsys, tmp_path):
    path = checkpoints[arch]
    code, result = run_json(
        capsys,
        "--model",
        str(path),
        "--prompt",
        PROMPT,
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--plan-cache",
        str(tmp_path),
    )
    assert code == 0, result["error"]
    assert result["token_ids"] == generate_reference(path, PROMPT, 24)
    assert [s["id"] for s in result["stages"]] == list(STAGE_IDS)
    assert {s["id"]: s["outcome"] for s in result["stages"]} == {
        sid: "skipped" if sid == "warmup" else "ok" for sid in STAGE_IDS
    }  # no CUDA graphs on the CPU
    assert all(s["attempts"] == (s["id"] != "warmup") for s in result["stages"])
    assert result["text"] == AutoTokenizer.from_pretrained(path).decode(result["token_ids"], skip_special_tokens=True)


def test_second_run_skips_the_probe_stages_and_reaches_the_same_capacity(checkpoints, capsys, tmp_path):
    argv = (
        "--model",
        str(checkpoints["llama"]),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "4",
        "--plan-cache",
        str(tmp_path),
    )
    _, cold = run_json(capsys, *argv)
    _, warm = run_json(capsys, *argv, "--no-prefix-cache")  # the plan is the same: the cache reserves nothing
    assert cold["plan"]["prefix_caching"] is True and warm["plan"]["prefix_caching"] is False
    outcomes = {s["id"]: (s["outcome"], s["skip_reason"]) for s in warm["stages"]}
    assert outcomes["estimation_build"] == outcomes["profiling"] == ("skipped", "plan-cache")
    assert {s["outcome"] for s in cold["stages"] if s["id"] != "warmup"} == {"ok"}
    assert outcomes["warmup"] == ("skipped", "cpu")
    assert warm["plan"]["kv_tokens"] == cold["plan"]["kv_tokens"] > 0
    assert warm["token_ids"] == cold["token_ids"]


def test_no_plan_cache_profiles_every_start(checkpoints, capsys, tmp_path):
    argv = ("--model", str(checkpoints["llama"]), "--max-tokens", "2", "--plan-cache", str(tmp_path), "--no-plan-cache")
    run_json(capsys, *argv)
    _, again = run_json(capsys, *argv)
    assert {s["outcome"] for s in again["stages"] if s["id"] != "warmup"} == {"ok"} and not list(tmp_path.iterdir())


def test_cache_clear_removes_every_cached_plan(checkpoints, capsys, tmp_path):
    run_json(capsys, "--model", str(checkpoints["llama"]), "--max-tokens", "2", "--plan-cache", str(tmp_path / "plans"))
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    assert main(["cache", "clear", "--plans", "--plan-cache", str(tmp_path / "plans")]) == 0
    assert "removed 1 cached plan" in capsys.readouterr().out and not (tmp_path / "plans").exists()


def test_cpu_budget_is_capped_by_what_max_batch_size_requests_can_use(checkpoints, capsys):
    _, result = run_json(
        capsys,
        "--model",
        str(checkpoints["llama"]),
        "--max-tokens",
        "2",
        "--no-plan-cache",
        "--max-batch-size",
        "3",
        "--max-seq-len",
        "100",
        "--tokens-per-block",
        "16",
    )
    plan = result["plan"]
    assert plan["limited_by"] == "max_batch_size"
    assert plan["kv_tokens"] == 3 * 112  # 3 requests x ceil(100 / 16) blocks of 16 tokens
    assert plan["kv_requests"] == plan["max_concurrent_requests"] == 3


def test_oom_in_the_profiling_forward_retries_with_a_lower_max_num_tokens(checkpoints, capsys, tmp_path, monkeypatch):
    """A real torch OutOfMemoryError from the engine's first forward (the profiling dummies: five
    requests, 4 x 63 + 4 tokens, in one step). The probe already is the size of that workload
    (9 blocks; a larger probe would shrink first, see tests/unit/test_probe.py), so the retry
    halves max_num_tokens."""
    real_run, calls = ModelRunner.run, []

    def first_call_runs_out(self, batch):
        calls.append(batch.total_tokens)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB ({batch.total_tokens} tokens)"
            )
        return real_run(self, batch)

    monkeypatch.setattr(ModelRunner, "run", first_call_runs_out)
    trace = tmp_path / "trace.jsonl"
    code, result = run_json(
        capsys,
        "--model",
        str(checkpoints["llama"]),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "6",
        "--max-num-tokens",
        "256",
        "--max-seq-len",
        "64",
        "--max-batch-size",
        "5",
        "--no-plan-cache",
        "--trace-file",
        str(trace),
    )
    assert code == 0 and len(result["token_ids"]) == 6
    profiling = next(s for s in result["stages"] if s["id"] == "profiling")
    assert (profiling["outcome"], profiling["attempts"]) == ("ok", 2)
    assert result["plan"]["max_num_tokens"] == result["plan"]["profile"]["max_num_tokens"] == 128
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    attempts = [s for s in spans if s["name"] == "bootstrap.stage.profiling.attempt"]
    assert [a["attributes"]["bootstrap.outcome"] for a in attempts] == ["failed", "ok"]
    assert attempts[1]["attributes"]["bootstrap.adapt.max_num_tokens"] == "256 -> 128"
    assert attempts[0]["status"] == "ERROR" and calls[:2] == [256, 128]  # whole max_num_tokens steps


BAD_INPUT = {
    "unknown model path": (["--model", "/no/such/model"], "not loadable"),
    "GGUF that is not GGUF": (["--model", "{gguf}"], "GGUF"),
    "corrupt checkpoint": (["--model", "{corrupt}"], "cannot be read"),
    "cuda without CUDA": (["--device", "cuda"], "no CUDA device"),
    "max_seq_len beyond positions": (["--max-seq-len", "100000"], "max_position_embeddings"),
    "prompt beyond max_seq_len": (["--max-seq-len", "8", "--prompt", PROMPT], "exceeds max_seq_len (8)"),
    "max_tokens 0": (["--max-tokens", "0"], "max_tokens"),
    "fp8 weights of random ones": (["--model", "random:smollm2-135m", "--quantization", "fp8"], "is drawn at random"),
    "fp8 weights of another family": (["--model", "{mixtral}", "--quantization", "fp8"], "engine's own code"),
    "chat without a chat template": (["--chat", "hello"], "no chat template"),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a machine without CUDA")
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_clear_line_and_exit_2(case, checkpoints, capsys, tmp_path):
    gguf, corrupt, mixtral = tmp_path / "fake.gguf", tmp_path / "corrupt", tmp_path / "mixtral"
    gguf.write_text("not a gguf file")
    mixtral.mkdir()  # a family the own code does not run: quantizing it at load is refused before any read
    (mixtral / "config.json").write_text(json.dumps(dict(MODEL_PRESETS["mixtral-8x7b"])))
    (mixtral / "model.safetensors").write_bytes((checkpoints["llama"] / "model.safetensors").read_bytes())
    corrupt.mkdir()
    for file in checkpoints["llama"].iterdir():
        (corrupt / file.name).write_bytes(file.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    argv, expected = BAD_INPUT[case]
    argv = [a.format(gguf=gguf, corrupt=corrupt, mixtral=mixtral) for a in argv]
    model = [] if "--model" in argv else ["--model", str(checkpoints["llama"])]
    device = [] if "--device" in argv else ["--device", "cpu"]
    code = main(["run", *device, *model, "--no-plan-cache", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("bootstrap: ")]) == 1


def test_an_empty_prompt_is_refused_before_any_stage_as_the_server_refuses_it(capsys):
    code = main(["run", "--device", "cpu", "--model", "/no/such/model", "--no-plan-cache", "--prompt", ""])
    err = capsys.readouterr().err  # the prompt is refused before the model is looked for
    assert (code, err.splitlines()) == (2, ["bootstrap: prompt: empty; at least one prompt token is needed"])


def test_console_script_prints_the_stage_table_and_the_text(checkpoints, tmp_path):
    """The installed entry point, as the README runs it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "run",
            "--device",
            "cpu",
            "--model",
            str(checkpoints["llama"]),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "5",
            "--plan-cache",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    for stage in STAGE_IDS:
        assert stage in proc.stdout and f"{stage:<18} started" in proc.stderr
    assert "KV budget" in proc.stdout and "limited by max_batch_size" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].count("w") == 5
