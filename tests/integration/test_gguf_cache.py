"""A user's ``.gguf`` file is dequantized once: its first load converts it into the model cache
(``gguf/<stem>-<key>/``, atomically, saying so and how long it took), every later load reads that
checkpoint (in the engine's own model code; ``bootstrap run`` then imports no transformers); a
file changed since gets a new conversion that replaces the old one; a cache that cannot be
written costs one warning, and the file loads as it is. Tiny GGUF files built here
(``helpers.tiny_gguf``), on the CPU."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers.tiny_gguf import write_tiny_gguf
from helpers.tiny_models import last_logits
from transformers import LlamaConfig, LlamaForCausalLM

from bootstrap.engine.models.decoder import DecoderLM
from bootstrap.engine.sources import checkpoint, conversions
from bootstrap.engine.sources.loader import config_dict, load_model
from bootstrap.engine.sources.model_cache import SOURCE_FILE, size_of, size_text

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
IDS = [1, 5, 7, 9, 11]


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def dequantized(monkeypatch) -> list[Path]:
    """Every GGUF file read through transformers from now on."""
    calls: list[Path] = []
    real = checkpoint.load_gguf_file

    def counting(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "load_gguf_file", counting)
    return calls


def test_a_gguf_file_is_converted_once_then_loaded_from_its_checkpoint(tmp_path, dequantized):
    model, cache, said = tiny_llama(0), tmp_path / "models", []
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    first = load_model(str(gguf), device=CPU, cache_dir=cache, progress=said.append)
    again = load_model(str(gguf), device=CPU, cache_dir=cache, progress=said.append)
    assert dequantized == [gguf]  # the first load only
    (converted,) = (cache / "gguf").iterdir()  # one conversion, no staging left
    assert re.fullmatch(r"tiny-[0-9a-f]{16}", converted.name)
    assert {"config.json", "model.safetensors", "tokenizer.json", SOURCE_FILE} <= {p.name for p in converted.iterdir()}
    assert json.loads((converted / SOURCE_FILE).read_text()) == {"gguf": conversions.identity(gguf)}
    assert isinstance(again.model, DecoderLM) and isinstance(first.model, DecoderLM)
    torch.testing.assert_close(last_logits(again.model, IDS), last_logits(model, IDS))
    assert again.tokenizer("abc").input_ids == first.tokenizer("abc").input_ids == [29, 5]
    assert config_dict(str(gguf), cache_dir=cache) == json.loads((converted / "config.json").read_text())
    start, done = said  # the conversion says what it does, then how long it took; the second load nothing
    assert (
        start == f"converting tiny.gguf to a checkpoint (once): {size_text(size_of(gguf))} of GGUF, dequantized "
        f"into {converted} ..."
    )
    assert re.fullmatch(
        rf"converting tiny\.gguf to a checkpoint \(once\): done in \d+\.\d s, "
        rf"{size_text(size_of(converted))} in {converted}",
        done,
    )


def test_a_file_changed_since_is_converted_again_and_its_older_conversion_removed(tmp_path, dequantized):
    gguf, cache = tmp_path / "tiny.gguf", tmp_path / "models"
    write_tiny_gguf(gguf, tiny_llama(0))
    load_model(str(gguf), device=CPU, cache_dir=cache)
    (before,) = (cache / "gguf").iterdir()
    newer = tiny_llama(1)
    write_tiny_gguf(gguf, newer)  # the same size; a later modification time
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, before.stat().st_mtime_ns + 10**9))
    loaded = load_model(str(gguf), device=CPU, cache_dir=cache)
    assert dequantized == [gguf, gguf]
    (after,) = (cache / "gguf").iterdir()
    assert after != before
    torch.testing.assert_close(last_logits(loaded.model, IDS), last_logits(newer, IDS))


def test_a_cache_that_cannot_be_written_costs_one_warning_and_the_file_loads_as_it_is(tmp_path, caplog, dequantized):
    model, blocked = tiny_llama(0), tmp_path / "a-file"
    blocked.write_text("in the way of the cache directory")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    loaded = load_model(str(gguf), device=CPU, cache_dir=blocked, attn_implementation="sdpa")
    assert torch.equal(last_logits(loaded.model, IDS), last_logits(model, IDS))
    assert dequantized == [gguf]  # once: the cache was found unwritable before the slow part
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"could not keep the conversion of {gguf} in {blocked} (")
    assert warning.endswith("loading the file itself, dequantized again on every start")


def test_a_first_config_read_converts_so_the_file_is_read_once(tmp_path, monkeypatch, dequantized):
    """Reading the GGUF's metadata for its config costs about as much as the conversion, which
    reads it too: the first config read converts, and the load then finds the conversion."""
    monkeypatch.setattr(checkpoint, "gguf_config", lambda *a, **k: pytest.fail("the GGUF's metadata read again"))
    gguf, cache = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(0)), tmp_path / "models"
    config = config_dict(str(gguf), cache_dir=cache)
    load_model(str(gguf), device=CPU, cache_dir=cache)
    assert dequantized == [gguf]
    assert config == json.loads((conversions.find(gguf, cache) / "config.json").read_text())


def test_bootstrap_run_converts_a_gguf_file_once_and_its_second_run_imports_no_transformers(tmp_path):
    """Two ``bootstrap run`` processes with a fresh home: the first converts (and says so on
    stderr), the second reuses the conversion and the plan, without a transformers module."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(0))
    script = (
        "import sys\nfrom bootstrap.cli.main import main\n"
        f"code = main(['run', '--device', 'cpu', '--model', {str(gguf)!r}, '--prompt', 'abc', '--max-tokens', '2',"
        " '--max-num-tokens', '64', '--max-batch-size', '4', '--max-seq-len', '128', '--json'])\n"
        "print('TRANSFORMERS', sorted(m for m in sys.modules if m.partition('.')[0] == 'transformers'))\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "HOME": str(tmp_path / "home")}  # the model cache and the plan cache under it

    def run() -> tuple[dict, str, str]:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        result, _, modules = done.stdout.rpartition("TRANSFORMERS")
        return json.loads(result), modules, done.stderr

    first, _, first_err = run()
    assert "from its GGUF metadata" not in first_err  # the conversion read the file: its config came with it
    assert f"converting tiny.gguf to a checkpoint (once): {size_text(size_of(gguf))} of GGUF" in first_err
    assert "converting tiny.gguf to a checkpoint (once): done in " in first_err
    second, modules, second_err = run()
    assert modules.strip() == "[]"
    assert "converting" not in second_err
    skipped = {s["id"]: (s["outcome"], s["skip_reason"]) for s in second["stages"]}
    assert skipped["estimation_build"] == skipped["profiling"] == ("skipped", "plan-cache")
    assert second["token_ids"] == first["token_ids"]


def test_a_conversion_says_it_is_still_working_until_it_ends(tmp_path, monkeypatch):
    """Reading a GGUF file says nothing for tens of seconds: a heartbeat line comes meanwhile. The
    conversion's first line waits for one (no timing assumed), and none comes after the last."""
    monkeypatch.setattr(conversions, "HEARTBEAT_S", 0.01)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(0))
    lines: list[str] = []
    beat = threading.Event()

    def progress(line: str) -> None:
        lines.append(line)
        if "still working" in line:
            beat.set()
        elif line.endswith(" ..."):
            assert beat.wait(60)

    conversions.ensure_converted(gguf, tmp_path / "models", progress)
    done = len(lines)
    assert lines[0].startswith("converting tiny.gguf to a checkpoint (once): ") and " done in " in lines[-1]
    assert lines[1].startswith("converting tiny.gguf to a checkpoint (once): still working, ")
    assert "bootstrap-conversion-heartbeat" not in [t.name for t in threading.enumerate()] and len(lines) == done
