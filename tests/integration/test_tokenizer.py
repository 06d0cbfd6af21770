"""The engine's own tokenizer (``bootstrap.engine.tokenizer``) against transformers, the reference:
token ids, decoded text and rendered chat templates equal on prompts with special tokens,
unicode and multi-turn chats, for the pipelines run from the file as it is and for those
transformers' Qwen2Tokenizer / GemmaTokenizer rebuild (checkpoints built here as Qwen2, Qwen3 and
Gemma ship theirs, and variants whose file the class overrides); and a checkpoint directory runs
in ``bootstrap run`` without transformers ever imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

from bootstrap.engine.tokenizer import Tokenizer as OwnTokenizer
from bootstrap.engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello world!",
    "  leading spaces and   runs   ",
    "unicode: héllo wörld — 日本語 🚀",
    "",
    "w1 w5 w9 w255 w999",
    "w5 w17 w33 w9 w100 w42 w7",  # special tokens (w1) inside words
    "<|im_start|>user inside<|im_end|>",
    "<s>bos in text</s>",
    "digits 1234567 and 3.14, x=42",
    "cafe\u0301 and café",
    "tabs\tand\r\nnew\n\n  lines\n",
    "<start_of_turn>user\nHi<end_of_turn>\n",
    "<bos>x<eos><pad><mask>",
    "<think>\nhm\n</think>\n\nok<|endoftext|>",
    " leading and trailing ",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✨"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "w7 again"},
    ],
]
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
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([*TEXTS, *[m["content"] for c in CHATS for m in c]] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|eot_id|>", add_bos_token=add_bos
    )
    fast.chat_template = LLAMA3_STYLE
    fast.save_pretrained(path)
    return path


CORPUS = [*TEXTS, *[m["content"] for c in CHATS for m in c]] * 20
CHATML = (  # Qwen2.5's, without its tools part
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
GEMMA_STYLE = (  # Gemma 3's turns, a system message folded into the first user turn
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + "
    "message['content'] | trim + '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def _added_tokens_decoder(backend: Tokenizer) -> dict:
    """tokenizer_config.json's ``added_tokens_decoder`` as hub checkpoints (transformers 4) carry it."""
    return {str(i): token.__getstate__() for i, token in backend.get_added_tokens_decoder().items()}


def _save(path: Path, backend: Tokenizer, config: dict, model_type: str, template: str | None = None) -> Path:
    path.mkdir(parents=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


def qwen_checkpoint(
    path: Path, model_type: str = "qwen2", tokenizer_class: str | None = "Qwen2Tokenizer", as_shipped: bool = True
) -> Path:
    """A byte-level BPE trained here. ``as_shipped``: as Qwen2 / Qwen3 ship it (NFC, the Qwen2 split
    then ByteLevel without its regex, a ByteLevel post-processor, ``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>`` added after the vocab and Qwen3's ``<think>`` / ``</think>`` as non-special added
    tokens; the hub's tokenizer_config.json with ``added_tokens_decoder``, null BOS and UNK, a ChatML
    template). Otherwise GPT-2's pipeline in the file (no normalizer, ByteLevel with its regex and a
    prefix space, no post-processor), which Qwen2Tokenizer replaces, and a transformers-5 style config
    (no ``added_tokens_decoder``, no named special tokens: the class's defaults) with
    chat_template.jinja."""
    backend = Tokenizer(models.BPE())
    if as_shipped:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    if as_shipped:
        backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.add_special_tokens(QWEN_SPECIALS)
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")])
    if not as_shipped:  # a fine-tune that names its reasoning tokens special (Qwen2Tokenizer then makes them so)
        config = {"tokenizer_class": tokenizer_class, "additional_special_tokens": ["<think>", "</think>"]}
        return _save(path, backend, config, model_type, CHATML)
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(backend),
        "additional_special_tokens": QWEN_SPECIALS[1:],
        "bos_token": None,
        "chat_template": CHATML,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }
    _save(path, backend, config, model_type)
    data = json.loads((path / "tokenizer.json").read_text())  # merges as "a b" strings, as Qwen's files have them
    data["model"]["merges"] = [" ".join(merge) for merge in data["model"]["merges"]]
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


def gemma_checkpoint(
    path: Path, model_type: str = "gemma", tokenizer_class: str | None = "GemmaTokenizer", as_shipped: bool = True
) -> Path:
    """A sentencepiece-like BPE with byte fallback as Gemma's tokenizer.json has it: its special
    tokens first (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``, ``<mask>``, ``<start_of_turn>``,
    ``<end_of_turn>``), the 256 byte pieces, then pieces trained here on the ASCII texts (the others
    fall back to bytes). ``as_shipped``: Gemma's pipeline (spaces replaced by "▁", no pre-tokenizer,
    a ``<bos> $A`` post-processor) and hub tokenizer_config.json (``added_tokens_decoder``,
    ``add_bos_token`` true, the template as ``chat_template``). Otherwise a Metaspace pipeline without
    post-processor and without ``<mask>``, which GemmaTokenizer replaces (and whose default
    ``<mask>`` it adds), the turn tokens as plain added tokens, and a transformers-5 style config
    with chat_template.jinja."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trained.train_from_iterator(
        [t for t in CORPUS if t.isascii()], trainers.BpeTrainer(vocab_size=300, show_progress=False)
    )
    model = json.loads(trained.to_str())["model"]
    specials = GEMMA_SPECIALS if as_shipped else [t for t in GEMMA_SPECIALS if t != "<mask>"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *sorted(model["vocab"], key=model["vocab"].get)]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if not as_shipped:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        # the turn tokens added as plain tokens, one of them named EOS (GemmaTokenizer then makes it special)
        backend.add_special_tokens(specials[:-2])
        backend.add_tokens([AddedToken(t, normalized=False) for t in specials[-2:]])
        config = {
            "add_bos_token": True,
            "bos_token": "<bos>",
            "eos_token": "<end_of_turn>",
            "tokenizer_class": tokenizer_class,
        }
        return _save(path, backend, config, model_type, GEMMA_STYLE)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    backend.add_special_tokens(specials)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": _added_tokens_decoder(backend),
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "bos_token": "<bos>",
        "chat_template": GEMMA_STYLE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>",
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    return _save(path, backend, config, model_type)


REBUILT = {
    "qwen2": lambda p: qwen_checkpoint(p),
    "qwen3": lambda p: qwen_checkpoint(p, "qwen3"),
    "qwen2-file-overridden": lambda p: qwen_checkpoint(p, "qwen2", "Qwen2TokenizerFast", as_shipped=False),
    "gemma": lambda p: gemma_checkpoint(p),
    "gemma2": lambda p: gemma_checkpoint(p, "gemma2"),
    "gemma-file-overridden": lambda p: gemma_checkpoint(p, "gemma", "GemmaTokenizerFast", as_shipped=False),
}


def word_checkpoint(path: Path) -> Path:
    return save_checkpoint("llama", path, chat_template=CHAT_TEMPLATE)


@pytest.fixture(params=["word", "bpe-bos", "bpe-no-bos", "smollm2", "smollm2-as-qwen2", "smollm2-as-gemma", *REBUILT])
def checkpoint(request, tmp_path) -> Path:
    if request.param in REBUILT:
        return REBUILT[request.param](tmp_path / request.param)
    if request.param == "word":
        return word_checkpoint(tmp_path / "word")
    if request.param.startswith("smollm2"):
        from bootstrap.engine.sources import smollm2

        path = smollm2.checkpoint_dir(request.getfixturevalue("smollm2_cache"))
        if request.param == "smollm2":
            return path
        # a real hub vocab (49k byte-level BPE) under the classes that rebuild it
        model_type = request.param.removeprefix("smollm2-as-")
        copy = tmp_path / request.param
        copy.mkdir()
        for name in ("tokenizer.json", "chat_template.jinja"):
            (copy / name).write_bytes((path / name).read_bytes())
        config = json.loads((path / "tokenizer_config.json").read_text())
        (copy / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": None}))
        (copy / "config.json").write_text(json.dumps({"model_type": model_type}))
        return copy
    return bpe_checkpoint(tmp_path / request.param, add_bos=request.param == "bpe-bos")


def test_ids_text_and_chats_equal_transformers(checkpoint):
    own, reference = load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    assert isinstance(own, OwnTokenizer)
    assert_same_backend(own, reference)
    for text in TEXTS:
        ids = own(text).input_ids
        assert ids == reference(text)["input_ids"], text
        for skip in (True, False):
            assert own.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
        assert getattr(own, name) == getattr(reference, name), name
        assert getattr(own, f"{name}_id") == getattr(reference, f"{name}_id"), name
    assert own.chat_template == reference.chat_template
    for chat in CHATS:
        for generation in (True, False):
            rendered = own.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
            assert rendered == reference.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
            ids = own.apply_chat_template(chat, add_generation_prompt=generation, return_dict=False)
            assert ids == reference.apply_chat_template(chat, add_generation_prompt=generation, return_dict=False)


def assert_same_backend(own: OwnTokenizer, reference, whole: bool = True) -> None:
    """The vocab and the added tokens (and their flags) as transformers ends with them, and
    (``whole``) the whole pipeline, serialized."""
    if whole:
        assert json.loads(own.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    assert own.backend.get_vocab() == reference.get_vocab()
    states = {i: t.__getstate__() for i, t in own.backend.get_added_tokens_decoder().items()}
    assert states == {i: t.__getstate__() for i, t in reference.added_tokens_decoder.items()}


@pytest.mark.parametrize("variant", [name for name in REBUILT if name.endswith("file-overridden")])
def test_where_the_class_overrides_the_file_the_file_as_it_is_differs(variant, tmp_path):
    """The checkpoints above whose tokenizer.json the class overrides do tell the two apart: run as
    the file says, their ids differ from transformers' (and the rebuilt pipeline's do not)."""
    path = REBUILT[variant](tmp_path / variant)
    own, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    as_file = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert [as_file.encode(t).ids for t in TEXTS] != [reference(t)["input_ids"] for t in TEXTS]
    assert [own(t).input_ids for t in TEXTS] == [reference(t)["input_ids"] for t in TEXTS]
    assert json.loads(own.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())


@pytest.mark.parametrize(
    "model_type, tokenizer_class, expected",
    [
        (None, "Qwen2TokenizerFast", "Qwen2Tokenizer"),
        ("llama", "GemmaTokenizer", "GemmaTokenizer"),
        ("qwen2", None, "Qwen2Tokenizer"),
        ("qwen2", "TokenizersBackend", "Qwen2Tokenizer"),
        ("qwen2", "GemmaTokenizerFast", "Qwen2Tokenizer"),
        ("qwen2", "LlamaTokenizer", "Qwen2Tokenizer"),
        ("qwen3", None, "Qwen2Tokenizer"),
        ("qwen3", "TokenizersBackend", "TokenizersBackend"),
        ("qwen3", "GemmaTokenizer", "GemmaTokenizer"),
        ("gemma", None, "GemmaTokenizer"),
        ("gemma2", "PreTrainedTokenizerFast", "TokenizersBackend"),
        ("gemma2", "Qwen2Tokenizer", "Qwen2Tokenizer"),
        ("gemma", "LlamaTokenizer", None),
        ("qwen3", "LlamaTokenizerFast", None),
        ("mistral", "Qwen2Tokenizer", None),
        ("gemma2", None, "GemmaTokenizer"),
        ("phi3", None, None),
        ("qwen3", "config.json:TokenizersBackend", "TokenizersBackend"),
        ("gemma", "config.json:Qwen2TokenizerFast", "Qwen2Tokenizer"),
        ("llama", "config.json:LlamaTokenizerFast", None),
    ],
)
def test_the_pipeline_is_that_of_the_class_transformers_picks(model_type, tokenizer_class, expected, tmp_path):
    """Which class AutoTokenizer picks for a model type and the class tokenizer_config.json (or,
    where it names none, config.json) names, on a Qwen-style or Gemma-style checkpoint whose file
    the class overrides (so that running the wrong one shows): run here as that class runs
    (TokenizersBackend: the file as it is), or left to transformers (None)."""
    build = gemma_checkpoint if "Gemma" in str(expected) else qwen_checkpoint
    in_model_config = str(tokenizer_class).startswith("config.json:")
    path = build(
        tmp_path / "ckpt", model_type or "llama", None if in_model_config else tokenizer_class, as_shipped=False
    )
    if in_model_config:
        model_config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**model_config, "tokenizer_class": tokenizer_class[12:]}))
    if model_type is None:
        (path / "config.json").unlink()
    reference, own = AutoTokenizer.from_pretrained(path, local_files_only=True), load_tokenizer(path)
    if expected is None:
        assert own is None
        return
    assert type(reference).__name__ == expected
    # TokenizersBackend gives a file without post-processor an empty TemplateProcessing (the same ids)
    assert_same_backend(own, reference, whole=expected != "TokenizersBackend")
    assert [own(t).input_ids for t in TEXTS] == [reference(t)["input_ids"] for t in TEXTS]
    assert [own.decode(own(t).input_ids) for t in TEXTS] == [reference.decode(reference(t)["input_ids"]) for t in TEXTS]


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
def test_word_level_checkpoints_of_qwen2_and_gemma2_load_as_transformers_loads_them(arch, tmp_path):
    """tiny_models' word-level checkpoints name TokenizersBackend: transformers runs that class (the
    file as it is) for gemma2, and for qwen2 Qwen2Tokenizer whatever the config names, which makes a
    BPE without merges of the word vocab (ids unlike the file's): no checkpoint ships that, so it is
    left to transformers."""
    path = save_checkpoint(arch, tmp_path / arch)
    own, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "w5 w17 w33"
    if arch == "qwen2":
        assert type(reference).__name__ == "Qwen2Tokenizer" and own is None
        assert reference(text)["input_ids"] != Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    else:
        assert type(reference).__name__ == "TokenizersBackend"
        assert own(text).input_ids == reference(text)["input_ids"]


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


def test_gemma_s_bos_comes_from_the_file_s_post_processor_not_add_bos_token(tmp_path):
    """As transformers does (from_pretrained drops add_bos_token beside tokenizer.json): the file's
    post-processor adds BOS, or nothing does, whatever add_bos_token (true in both configs) says."""
    for as_shipped in (True, False):
        path = gemma_checkpoint(tmp_path / str(as_shipped), as_shipped=as_shipped)
        own, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert (own("Hi there").input_ids[0] == own.bos_token_id) is as_shipped
        assert own("Hi there").input_ids == reference("Hi there")["input_ids"]


def test_qwen_and_gemma_checkpoints_load_without_importing_transformers(tmp_path):
    paths = [REBUILT[name](tmp_path / name) for name in ("qwen3", "gemma2", "qwen2-file-overridden")]
    without_transformers(
        "from pathlib import Path\nfrom bootstrap.engine.tokenizer import load_tokenizer\n"
        f"for path in {[str(p) for p in paths]!r}:\n"
        "    tok = load_tokenizer(Path(path))\n"
        "    print(tok.decode(tok('Hi <|im_end|>').input_ids),"
        " len(tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])))\n"
    )


def without_transformers(script: str) -> str:
    """Run ``script`` in a fresh interpreter and assert it exited 0 with no transformers module
    ever imported; its stdout before the module list."""
    listing = (
        "import sys\nprint('TRANSFORMERS',"
        " sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", f"{script}\n{listing}"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "TRANSFORMERS []" in done.stdout, done.stdout[-500:]
    return done.stdout[: done.stdout.rindex("TRANSFORMERS")]


FAMILY_DIRS = {
    "llama": word_checkpoint,
    "mistral": lambda p: save_checkpoint("mistral", p, chat_template=CHAT_TEMPLATE),
    **{name: REBUILT[name] for name in ("qwen2", "qwen3", "gemma", "gemma2")},
}


def with_weights(path: Path, family: str) -> Path:
    """``path``'s tokenizer beside a tiny seeded model of ``family`` (its config.json replaced)."""
    if (path / "model.safetensors").is_file():
        return path
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", sorted(FAMILY_DIRS))
def test_bootstrap_run_on_a_checkpoint_directory_never_imports_transformers(family, tmp_path):
    """Each family the own code runs, with a tokenizer as the family ships it: ``bootstrap run``
    loads, chats and answers without a single transformers module in the process."""
    path = with_weights(FAMILY_DIRS[family](tmp_path / family), family)
    out = without_transformers(
        "from bootstrap.cli.main import main\n"
        f"assert main(['run', '--device', 'cpu', '--model', {str(path)!r}, '--chat', 'Hello there',"
        " '--max-tokens', '4', '--no-plan-cache', '--json']) == 0\n"
    )
    assert json.loads(out)["finish_reason"] in ("length", "stop")
