"""Tiny tokenizers of several models (byte-level BPE, WordPiece, word-level), trained or built here
and saved as a checkpoint directory ships them (``tokenizer.json``, ``tokenizer_config.json``, a
``config.json`` naming the model type), with the config options a test sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ["<unk>", "<s>", "</s>"]
# what decoding with clean_up_tokenization_spaces rewrites: spaces before punctuation and contractions
CORPUS = ["Hello , world . Is it ? Yes ! I do n't know , it 's you 're I 'm we 've ' quoted ' ."] * 20


def _bpe() -> Tokenizer:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def _wordpiece() -> Tokenizer:
    backend = Tokenizer(models.WordPiece(unk_token="<unk>"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=False)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIALS))
    return backend


def _wordlevel() -> Tokenizer:
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return backend


MODELS = {"bpe": _bpe, "wordpiece": _wordpiece, "wordlevel": _wordlevel}


def tokenizer_checkpoint(path: Path, model: str, model_type: str = "llama", **options: Any) -> Path:
    """A directory with ``MODELS[model]``'s tokenizer and ``options`` in its tokenizer_config.json."""
    path.mkdir(parents=True)
    MODELS[model]().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "</s>"} | options))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path
