"""A checkpoint's tokenizer without transformers: ``tokenizer.json`` through ``tokenizers``, the
special tokens of ``tokenizer_config.json``, and the chat template (``chat_template.jinja`` or the
config's ``chat_template``) rendered with jinja2 as transformers renders it (sandboxed,
``trim_blocks`` and ``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and
``strftime_now``, the special tokens as variables).

``load_tokenizer`` works out the class transformers 5's ``AutoTokenizer`` picks (``_pipeline``)
and runs three of them here, for the model types of ``MODEL_TYPES``, as tested against the
installed transformers: ``TokenizersBackend`` / ``PreTrainedTokenizerFast`` (the file's pipeline
as it is), and ``Qwen2Tokenizer`` and ``GemmaTokenizer``, which keep only the file's BPE vocab,
merges and post-processor and put their own options, normalizer, pre-tokenizer, decoder and
default special tokens around them (``_rebuilt`` replays that). Any other class or model type, a
file the class would turn into another model, or no ``tokenizer.json``: None, and the caller
loads it through transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from bootstrap.config import ConfigError

# The pipeline of the class a config names ("file": tokenizer.json's as it is) ...
PIPELINES = {
    "TokenizersBackend": "file",
    "PreTrainedTokenizerFast": "file",
    "Qwen2Tokenizer": "qwen2",
    "Qwen2TokenizerFast": "qwen2",
    "GemmaTokenizer": "gemma",
    "GemmaTokenizerFast": "gemma",
}
# ... and of the class transformers' tokenizer mapping gives a model type where it names none
# (None: no config.json beside the tokenizer). qwen2 is one of transformers'
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: Qwen2Tokenizer whatever the config names; mistral's
# mapping (MistralCommonBackend where mistral-common is installed) keeps only the "file" classes here.
MODEL_TYPES = {
    None: "file",
    "llama": "file",
    "mistral": "file",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "gemma": "gemma",
    "gemma2": "gemma",
}
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The special tokens of Qwen2Tokenizer's / GemmaTokenizer's __init__ signature, for keys the config lacks.
DEFAULTS = {
    "qwen2": {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "gemma": {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
}
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of the checkpoint directory ``path``, or None (see the module docstring)."""
    config_file, model_file = path / "tokenizer_config.json", path / "config.json"
    config = _json(config_file) if config_file.is_file() else {}
    model_config = _json(model_file) if model_file.is_file() else {}
    pipeline = _pipeline(
        config.get("tokenizer_class") or model_config.get("tokenizer_class"), model_config.get("model_type")
    )
    file = path / "tokenizer.json"
    if not file.is_file() or pipeline is None:
        return None
    template_file = path / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    if pipeline == "file":
        try:
            return Tokenizer(Backend.from_file(str(file)), config, template)
        except Exception as exc:  # tokenizers' own error says only what its parser met ("EOF while parsing ...")
            raise ConfigError(f"{file}: not a tokenizer file ({exc})") from None
    rebuilt = _rebuilt(path, _json(file), config, pipeline)
    return None if rebuilt is None else Tokenizer(rebuilt[0], {**config, **rebuilt[1]}, template)


def _json(file: Path) -> Any:
    """The JSON object in ``file``; ``ConfigError`` naming the file when it holds none."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{file}: must hold a JSON object, got {type(value).__name__}")
    return value


def _pipeline(declared: str | None, model_type: str | None) -> str | None:
    """The pipeline of the class transformers' AutoTokenizer picks (from ``tokenizer_config.json``'s
    class, else ``config.json``'s, and the model type), or None for a class not ours:
    ``Qwen2Tokenizer`` for qwen2 whatever the config names, and for qwen3 unless it names another;
    ``GemmaTokenizer`` for gemma and gemma2 unless it names another; either where the config names
    it; the file's own pipeline for ``TokenizersBackend`` / ``PreTrainedTokenizerFast`` (its
    post-processor decides BOS and EOS, whatever ``add_bos_token`` says)."""
    if model_type not in MODEL_TYPES:
        return None
    if declared is None or model_type == "qwen2":
        return MODEL_TYPES[model_type]
    pipeline = PIPELINES.get(declared)
    return None if model_type == "mistral" and pipeline != "file" else pipeline


def _rebuilt(path: Path, data: dict, config: Mapping[str, Any], pipeline: str) -> tuple[Backend, dict] | None:
    """The backend Qwen2Tokenizer / GemmaTokenizer (``pipeline``) make of tokenizer.json (``data``) and
    their named special tokens, replaying their ``__init__`` and TokenizersBackend's on the arguments
    transformers' ``from_pretrained`` passes them (their own default special tokens for keys the
    config lacks, the added and special tokens added back); None where that is not reproduced here."""
    model = data["model"]
    if model.get("type") != "BPE":
        return None  # the class would make a BPE without merges of another model's vocab; no checkpoint ships that
    decoded = config.get("added_tokens_decoder")
    if decoded is None:  # transformers 5 writes none: from_pretrained then takes tokenizer.json's added tokens
        if (path / "special_tokens_map.json").is_file() or (path / "added_tokens.json").is_file():
            return None  # ... and merges these legacy files in, which is not reproduced here
        decoded = {token["id"]: {k: v for k, v in token.items() if k != "id"} for token in data["added_tokens"]}
    added = {int(i): _token(t) for i, t in decoded.items()}
    named = {key: _token(config[key]) if key in config else DEFAULTS[pipeline].get(key) for key in SPECIAL}
    # Model-specific special tokens (other *_token keys): those saved as AddedToken dicts, then strings.
    own = {k: v for k, v in config.items() if k.endswith("_token") and k not in SPECIAL}
    named |= {k: _token(v) for k, v in own.items() if isinstance(v, Mapping) and v.get("__type") == "AddedToken"}
    named |= {k: v for k, v in own.items() if isinstance(v, str)}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, Mapping):
        named |= {k: _token(v) for k, v in extra.items()}
        extra = []
    extra = [_token(t) for t in extra]

    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    if pipeline == "qwen2":
        backend = Backend(
            models.BPE(
                vocab=model["vocab"],
                merges=merges,
                dropout=None,
                unk_token=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        backend.decoder = decoders.ByteLevel()
        backend.normalizer = normalizers.NFC()
        prefix = config.get("add_prefix_space")
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix if prefix is not None else False, use_regex=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        unk = str(named["unk_token"])  # "None" for a null unk_token, as the class has it
        backend = Backend(
            models.BPE(
                vocab=model["vocab"], merges=merges, fuse_unk=True, unk_token=unk, dropout=None, byte_fallback=True
            )
        )
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        backend.normalizer = normalizers.Replace(" ", "▁")
    minimal = {**data, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []}
    if processor := Backend.from_str(json.dumps(minimal)).post_processor:
        backend.post_processor = processor

    # TokenizersBackend.__init__: the added tokens in id order, then the special ones still missing.
    tokens = [token for _, token in sorted(added.items())]
    contents = [str(token) for token in tokens]
    for token in [*named.values(), *extra]:
        if token is not None and str(token) not in contents and token not in tokens:
            tokens.append(token)
    names = [str(token) for token in named.values() if token]
    for i, token in enumerate(tokens):
        if isinstance(token, str):
            tokens[i] = AddedToken(token, special=True)
        elif not token.special and str(token) in names:
            token.special = True
    if tokens:
        backend.add_tokens(tokens)
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    if backend.post_processor is None:  # from_pretrained drops add_bos_token / add_eos_token beside tokenizer.json
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    if pipeline == "qwen2":  # Qwen2Tokenizer's last step: every special token (re)added as a special AddedToken
        every = dict.fromkeys(str(token) for token in [*named.values(), *extra] if token is not None)
        backend.add_tokens([AddedToken(token, special=True) for token in every])
    return backend, {key: None if named[key] is None else str(named[key]) for key in SPECIAL}


def _token(value: Any) -> Any:
    return AddedToken(**{k: v for k, v in value.items() if k != "__type"}) if isinstance(value, Mapping) else value


class Tokenizer:
    """What the engine, ``bootstrap run`` and the server call: ``__call__``, ``decode``,
    ``apply_chat_template``, ``chat_template`` and the special tokens and their ids."""

    def __init__(self, backend: Backend, config: Mapping[str, Any], chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template if isinstance(chat_template, str) else None
        self.special_tokens_map = {k: _content(config[k]) for k in SPECIAL if config.get(k) is not None}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers 5 skips the cleanup for BPE (it strips real spaces) unless the config insists
        self.clean_up_bpe = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))

    def __getattr__(self, name: str) -> Any:
        if name in SPECIAL:
            return self.special_tokens_map.get(name)
        if name.endswith("_token_id") and f"{name[:-3]}" in SPECIAL:
            token = self.special_tokens_map.get(name[:-3])
            return None if token is None else self.backend.token_to_id(token)
        raise AttributeError(name)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(input_ids=self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and (self.clean_up_bpe or type(self.backend.model).__name__ != "BPE"):
            text = _clean_up(text)
        return text

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The rendered chat (``tokenize=False``) or its token ids (the rendering's special tokens
        come from the template, so none are added)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {**self.special_tokens_map, **kwargs}
        text = _compiled(self.chat_template).render(
            messages=[dict(m) for m in conversation],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoded(input_ids=ids) if return_dict else ids


class Encoded(dict):
    """``{"input_ids": [...]}``, also as ``.input_ids`` (as transformers' ``BatchEncoding``)."""

    @property
    def input_ids(self) -> list[int]:
        return self["input_ids"]


def _content(value: Any) -> str:
    return value["content"] if isinstance(value, Mapping) else str(value)


def _clean_up(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
