"""A checkpoint's tokenizer without transformers: ``tokenizer.json`` through ``tokenizers``, the
special tokens of ``tokenizer_config.json``, and the chat template (``chat_template.jinja``, as
transformers 5 writes it, or the config's ``chat_template``) rendered with jinja2 the way
transformers renders it: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``, and the special tokens
as variables.

``load_tokenizer`` takes this path for the tokenizer classes transformers itself runs straight
from ``tokenizer.json`` (``TokenizersBackend``, ``PreTrainedTokenizerFast``) and the model types
it keeps them for (``OWN_MODEL_TYPES``), and as transformers
does for them, it uses the file's pipeline as it is (its post-processor decides BOS and EOS,
whatever ``add_bos_token`` says; tested against the installed transformers); a class that
rebuilds its pipeline in Python (``LlamaTokenizer``, ``Qwen2Tokenizer``, ...) or a checkpoint
without ``tokenizer.json`` returns None, and the caller loads it through transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

OWN_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")
# Model types for which transformers keeps the generic class (its tokenizer mapping names none, or
# the generic one); for others (qwen2, qwen3: Qwen2Tokenizer; gemma: GemmaTokenizer) it picks a
# class of its own even where tokenizer_config.json says TokenizersBackend, and that class
# rebuilds the pipeline, so those stay on transformers.
OWN_MODEL_TYPES = (None, "llama", "mistral")  # None: no config.json beside the tokenizer
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of the checkpoint directory ``path``, or None (see the module docstring)."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if not (path / "tokenizer.json").is_file() or config.get("tokenizer_class") not in OWN_CLASSES:
        return None
    if _model_type(path) not in OWN_MODEL_TYPES:
        return None
    template_file = path / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    return Tokenizer(Backend.from_file(str(path / "tokenizer.json")), config, template)


class Tokenizer:
    """What the engine, ``bootstrap run`` and the server call: ``__call__``, ``decode``,
    ``apply_chat_template``, ``chat_template`` and the special tokens and their ids."""

    def __init__(self, backend: Backend, config: Mapping[str, Any], chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template if isinstance(chat_template, str) else None
        self.special_tokens_map = {k: _content(config[k]) for k in SPECIAL if config.get(k) is not None}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

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
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            text = _clean_up(text)
        return text

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False, tools: list[dict] | None = None,
                            **kwargs: Any) -> Any:  # fmt: skip
        """The rendered chat (``tokenize=False``) or its token ids (the rendering's special tokens
        come from the template, so none are added)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {**self.special_tokens_map, **kwargs}
        text = _compiled(self.chat_template).render(messages=[dict(m) for m in conversation], tools=tools,
                                                    add_generation_prompt=add_generation_prompt, **variables)  # fmt: skip
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoded(input_ids=ids) if return_dict else ids


def _model_type(path: Path) -> str | None:
    model_config = path / "config.json"
    return json.loads(model_config.read_text(encoding="utf-8")).get("model_type") if model_config.is_file() else None


class Encoded(dict):
    """``{"input_ids": [...]}``, also as ``.input_ids`` (as transformers' ``BatchEncoding``)."""

    @property
    def input_ids(self) -> list[int]:
        return self["input_ids"]


def _content(value: Any) -> str:
    return value["content"] if isinstance(value, Mapping) else str(value)


def _clean_up(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
