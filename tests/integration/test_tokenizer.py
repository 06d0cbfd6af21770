"""The engine's own tokenizer (``bootstrap.engine.tokenizer``) against transformers, the reference:
token ids, decoded text and rendered chat templates equal on prompts with special tokens,
unicode and multi-turn chats; and a checkpoint directory runs in ``bootstrap run`` without
transformers ever imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bootstrap.engine.tokenizer import Tokenizer as OwnTokenizer
from bootstrap.engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello world!", "  leading spaces and   runs   ", "unicode: héllo wörld — 日本語 🚀", "", "w1 w5 w9 w255 w999",
         "w5 w17 w33 w9 w100 w42 w7",  # special tokens (w1) inside words
         "<|im_start|>user inside<|im_end|>", "<s>bos in text</s>"]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✨"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "w7 again"}],
]  # fmt: skip
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def bpe_checkpoint(path: Path, add_bos: bool) -> Path:
    """A byte-level BPE trained here, with special tokens, a BOS post-processor and a Llama-3 style
    template, saved by transformers the way a Llama-3 checkpoint ships its tokenizer."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = __import__("tokenizers").decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([*TEXTS, *[m["content"] for c in CHATS for m in c]] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|eot_id|>", add_bos_token=add_bos)
    fast.chat_template = LLAMA3_STYLE
    fast.save_pretrained(path)
    return path


def word_checkpoint(path: Path) -> Path:
    return save_checkpoint("llama", path, chat_template=CHAT_TEMPLATE)


@pytest.fixture(params=["word", "bpe-bos", "bpe-no-bos", "smollm2"])
def checkpoint(request, tmp_path, smollm2_cache) -> Path:
    if request.param == "word":
        return word_checkpoint(tmp_path / "word")
    if request.param == "smollm2":
        from bootstrap.engine.sources import smollm2

        return smollm2.checkpoint_dir(smollm2_cache)
    return bpe_checkpoint(tmp_path / request.param, add_bos=request.param == "bpe-bos")


def test_ids_text_and_chats_equal_transformers(checkpoint):
    own, reference = load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    assert isinstance(own, OwnTokenizer)
    for text in TEXTS:
        ids = own(text).input_ids
        assert ids == reference(text)["input_ids"], text
        for skip in (True, False):
            assert own.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(own, name) == getattr(reference, name), name
        assert getattr(own, f"{name}_id") == getattr(reference, f"{name}_id"), name
    assert own.chat_template == reference.chat_template
    for chat in CHATS:
        for generation in (True, False):
            rendered = own.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
            assert rendered == reference.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
            ids = own.apply_chat_template(chat, add_generation_prompt=generation, return_dict=False)
            assert ids == reference.apply_chat_template(chat, add_generation_prompt=generation, return_dict=False)


@pytest.mark.parametrize("file_bos, flag", [(True, False), (False, True), (None, True), (None, False)])
def test_bos_follows_the_file_s_post_processor_as_transformers_does(file_bos, flag, tmp_path):
    """As transformers does for these classes (the reference, as installed): tokenizer.json's
    post-processor decides, whatever ``add_bos_token`` says; a file without one adds no BOS."""
    path = bpe_checkpoint(tmp_path / "ckpt", add_bos=bool(file_bos))
    if file_bos is None:
        data = json.loads((path / "tokenizer.json").read_text())
        (path / "tokenizer.json").write_text(json.dumps({**data, "post_processor": None}))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": flag}))
    own, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    expected_bos = bool(file_bos)
    assert (own("Hello").input_ids[0] == own.bos_token_id) is expected_bos
    assert own("Hello").input_ids == reference("Hello")["input_ids"]


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_model_types_transformers_gives_a_class_of_its_own_stay_on_transformers(arch, tmp_path):
    """transformers picks Qwen2Tokenizer / GemmaTokenizer for these model types whatever the
    tokenizer config says, and those rebuild the pipeline: on the word tokenizer its ids differ
    from tokenizer.json's, so they are not ours to reproduce."""
    path = save_checkpoint(arch, tmp_path / arch)
    assert load_tokenizer(path) is None


def test_tokenizer_classes_that_rebuild_their_pipeline_stay_on_transformers(tmp_path):
    path = word_checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert load_tokenizer(path) is None
    (path / "tokenizer.json").unlink()
    assert load_tokenizer(path) is None


def test_a_template_error_is_the_template_s_message(tmp_path):
    path = word_checkpoint(tmp_path / "ckpt")
    (path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(Exception, match="roles must alternate"):
        load_tokenizer(path).apply_chat_template(CHATS[0])


def test_bootstrap_run_on_a_checkpoint_directory_never_imports_transformers(tmp_path):
    path = word_checkpoint(tmp_path / "ckpt")
    script = (
        "import sys\nfrom bootstrap.cli import main\n"
        f"code = main(['run', '--device', 'cpu', '--model', {str(path)!r}, '--chat', 'w7 w8', '--max-tokens', '4',"
        " '--no-plan-cache', '--json'])\n"
        "print('TRANSFORMERS', sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "TRANSFORMERS []" in done.stdout, done.stdout[-500:]
