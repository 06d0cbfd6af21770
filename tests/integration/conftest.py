"""Checkpoints most integration tests run on: tiny llama and qwen2 directories with their
tokenizers (``helpers.tiny_models.save_checkpoint``), and the llama with a chat template
(``checkpoint``, what the server's tests send chat to), written once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return save_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama", CHAT_TEMPLATE)
