"""``clean_up_tokenization_spaces`` in the engine's own tokenizer against transformers: applied on
decode for WordPiece and word-level models, ignored for BPE (transformers 5 skips it there, it
would strip real spaces) unless the config forces it."""

from __future__ import annotations

import pytest
from helpers.tiny_tokenizers import CORPUS, MODELS, tokenizer_checkpoint
from transformers import AutoTokenizer

from bootstrap.engine.tokenizer import load_tokenizer

TEXTS = [CORPUS[0], "a ' b 's . , ! ?", "no cleanup here", "<s> Hello , world . </s>"]
OPTIONS = {
    "on": {"clean_up_tokenization_spaces": True},
    "off": {"clean_up_tokenization_spaces": False},
    "unset": {},
    "forced on BPE": {
        "clean_up_tokenization_spaces": True,
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
    },
}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_decode_cleans_up_spaces_as_transformers_does(model, options, tmp_path):
    path = tokenizer_checkpoint(tmp_path / "tok", model, **OPTIONS[options])
    own, reference = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert own is not None
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert own(text).input_ids == ids
        for skip in (False, True):
            assert own.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text


def test_the_cleanup_changes_the_text_where_it_applies(tmp_path):
    """The cases above are not all alike: the cleanup removes spaces for WordPiece, not for BPE."""
    decoded = {}
    for model in ("wordpiece", "bpe"):
        own = load_tokenizer(tokenizer_checkpoint(tmp_path / model, model, clean_up_tokenization_spaces=True))
        decoded[model] = own.decode(own("Hello , world . I do n't").input_ids)
    assert decoded == {"wordpiece": "Hello, world. I don't", "bpe": "Hello , world . I do n't"}
